"""No host sync in a training step outside log steps (issue 12), counted on CPU (tests/host_syncs.py), and the
device-side non-finite skip it rests on: fused AdamW's found_inf leaves parameters, moments and step counts exactly
as they were, and a finite step is the plain step bit for bit. (On a GPU: tests/gpu/test_host_syncs_cuda.py.)"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

from tests.host_syncs import SyncRecorder
from torchtitan_glm.components.step_stats import StepStats, optimizer_step, supports_device_skip


def _trainer(tmp_path, *overrides: str):
    """The debug model's trainer on one local rank; a fresh port each call (a test may build several in turn; the
    `world_of_one` fixture of tests/conftest.py tears the group and the environment down)."""
    from torchtitan_glm.config import load_config
    from torchtitan_glm.train import Trainer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    cfg = load_config(["--config", "train_configs/debug_model.toml", "--training.seq_len", "32",
                       "--training.local_batch_size", "1", "--checkpoint.enable", "false",
                       "--metrics.enable_tensorboard", "false", "--lr_scheduler.warmup_steps", "1",
                       f"--job.dump_folder={tmp_path}", *overrides])
    return Trainer(cfg)


def _describe(syncs) -> str:
    return "\n".join(f"step {s.step}: {s.what} at {s.where}" for s in syncs)


@pytest.mark.parametrize("accumulate", [(), ("--training.global_batch_size", "2",
                                              "--parallelism.fsdp_reshard_after_forward", "never")],
                         ids=["one_batch", "two_microbatches"])
def test_fused_adamw_training_reads_nothing_from_the_device(tmp_path, world_of_one, accumulate):
    """The whole loop (log steps included: their host reads are of the copies queued in the step) with fused
    AdamW: the non-finite skip is decided on the device, so no step reads a device value; also when a step
    accumulates two microbatches."""
    trainer = _trainer(tmp_path, "--training.steps", "5", "--metrics.log_freq", "2",
                       "--optimizer.implementation", "fused", *accumulate)
    assert trainer.accumulation.steps == (2 if accumulate else 1)
    assert trainer.device_skip
    with SyncRecorder(step=lambda: trainer.step) as rec:
        losses = trainer.train()
    assert len(losses) == 5 and all(map(torch.isfinite, torch.tensor(losses)))
    assert not rec.syncs, "host syncs in the training loop:\n" + _describe(rec.syncs)
    assert not trainer.stats.pending, "every step was resolved by the end"


def test_fused_low_bit_adamw_reads_nothing_from_the_device(tmp_path, world_of_one):
    """AdamW8bit's fused step under on_nonfinite = "skip": the step counts live on the device, the skip is its
    found_inf, so no step reads a device value. torchao keeps the learning rate as a host tensor, which the step reads
    (exempt: no device there)."""
    trainer = _trainer(tmp_path, "--training.steps", "3", "--metrics.log_freq", "3", "--optimizer.name", "AdamW8bit",
                       "--training.on_nonfinite", "skip")
    assert trainer.device_skip and trainer.optimizer.implementation == "fused"

    def host_lr(t: torch.Tensor) -> bool:
        return any(t is g["lr"] for g in trainer.optimizer.param_groups)

    with SyncRecorder(step=lambda: trainer.step, exempt=host_lr) as rec:
        losses = trainer.train()
    assert len(losses) == 3 and all(map(torch.isfinite, torch.tensor(losses)))
    # step 1 creates torchao's states, whose code map is built from host tensors (on the host on a GPU too)
    later = [s for s in rec.syncs if s.step > 1]
    assert not later, "host syncs in the training loop:\n" + _describe(later)
    assert all(s.where.startswith("components/lowbit_step.py") for s in rec.syncs), _describe(rec.syncs)


def test_other_optimizers_read_one_flag_per_step_only_to_skip(tmp_path, world_of_one):
    """foreach AdamW has no found_inf. Under on_nonfinite = "skip" each step reads exactly the one non-finite flag,
    and nothing else that lives on the device (its step counters stay on the host and are exempt); under "stop" (the
    run ends at the step's first read, before any save) no step reads anything."""
    for policy, flag_steps in (("skip", [1, 2, 3]), ("stop", [])):
        trainer = _trainer(tmp_path / policy, "--training.steps", "3", "--metrics.log_freq", "3",
                           "--optimizer.implementation", "foreach", "--training.on_nonfinite", policy)
        assert not trainer.device_skip

        def step_counter(t: torch.Tensor, trainer=trainer) -> bool:
            return any(t is s.get("step") for s in trainer.optimizer.state.values())

        with SyncRecorder(step=lambda trainer=trainer: trainer.step, exempt=step_counter) as rec:
            losses = trainer.train()
        assert len(losses) == 3
        assert [s.step for s in rec.syncs] == flag_steps, (policy, _describe(rec.syncs))
        assert all(s.where.startswith("components/step_stats.py") for s in rec.syncs), _describe(rec.syncs)
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_statistics_are_read_one_step_late_outside_log_steps(tmp_path, world_of_one):
    trainer = _trainer(tmp_path, "--training.steps", "4", "--metrics.log_freq", "4",
                       "--optimizer.implementation", "fused")
    seen: list[list[int]] = []
    original = trainer.stats.resolve

    def resolve(upto):
        out = original(upto)
        seen.append([m["step"] for m in out])
        return out

    trainer.stats.resolve = resolve
    trainer.train()
    assert seen == [[], [1], [2], [3, 4]]


# ------------------------------------------------------------------------------------ the device-side skip
def _model_and_grads(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model(torch.randn(5, 8)).square().sum().backward()
    return model


def _state(opt):
    return [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]


def test_found_inf_skips_the_update_exactly_and_a_finite_step_is_the_plain_step():
    model, ref = _model_and_grads(0), _model_and_grads(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, fused=True)
    cpu = torch.device("cpu")
    assert supports_device_skip(opt, device=cpu)
    assert not supports_device_skip(torch.optim.AdamW(model.parameters(), foreach=True), device=cpu)
    assert not supports_device_skip(opt, device=torch.device("cuda"))  # host parameters, device flag
    optimizer_step(opt, found_inf=torch.zeros(()))
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    before = [p.detach().clone() for p in model.parameters()], _state(opt)
    for p in model.parameters():
        p.grad.fill_(float("nan"))
    optimizer_step(opt, found_inf=torch.ones(()))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before[0])), "a skipped step moved weights"
    for now, then in zip(_state(opt), before[1]):
        assert all(torch.equal(now[k], then[k]) for k in now), "a skipped step changed the optimizer state"
    assert not hasattr(opt, "found_inf")


@pytest.mark.parametrize("bad", [None, "loss", "grad_norm", "mtp_loss", "indexer_kl_loss"])
def test_step_stats_flag_what_is_not_finite(bad):
    stats = StepStats(device=torch.device("cpu"), dp_size=2)
    nan = torch.tensor(float("nan"))
    ce = nan if bad == "loss" else torch.tensor(6.0)
    pending = stats.record(step=7, lr=1e-3, documents=["a.txt"], ce_sum=ce,
                           mtp_sum=nan if bad == "mtp_loss" else torch.tensor(3.0),
                           kl=torch.tensor(float("inf")) if bad == "indexer_kl_loss" else torch.tensor(0.5),
                           grad_norm=nan if bad == "grad_norm" else torch.tensor(2.0), count=torch.tensor(3.0),
                           mtp_count=torch.tensor(0.0), stop=False)
    pending.extra["expert_load_imbalance"] = torch.tensor(1.5)
    stats.finish(pending)
    assert float(pending.bad) == (0.0 if bad is None else 1.0)
    (m,) = stats.resolve(7)
    assert [s.split()[0] for s in m["nonfinite"]] == ([] if bad is None else [bad])
    assert m["step"] == 7 and m["documents"] == ["a.txt"] and m["tokens"] == 3 and m["stop"] is False
    if bad is None:
        assert (m["loss"], m["mtp_loss"], m["indexer_kl_loss"], m["grad_norm"]) == (2.0, 3.0, 0.25, 2.0)
        assert m["expert_load_imbalance"] == 1.5
    else:
        assert "expert_load_imbalance" not in m  # only finite steps report it


def test_steps_resolve_in_order_up_to_the_step_asked():
    stats = StepStats(device=torch.device("cpu"))
    for step in (1, 2, 3):
        p = stats.record(step=step, lr=0.1, documents=[], ce_sum=torch.tensor(float(step)), mtp_sum=None,
                         kl=None, grad_norm=torch.tensor(1.0), count=torch.tensor(1.0), mtp_count=None,
                         stop=step == 2)
        stats.finish(p)
    first = stats.resolve(2)
    assert [(m["step"], m["loss"], m["stop"]) for m in first] == [(1, 1.0, False), (2, 2.0, True)]
    assert "mtp_loss" not in first[0] and "indexer_kl_loss" not in first[0]
    assert [m["step"] for m in stats.resolve(5)] == [3] and stats.resolve(9) == []
