"""training.global_batch_size on one rank: two microbatches of one row accumulate the gradients of one batch of two
rows (first step's gradients, two steps' losses, parameters and router biases; tests/distributed/
_accumulation_worker.py::compare), with FSDP2's reduce deferred to the last microbatch (nothing is split over
ranks) and with its gathered parameters held between microbatches (fsdp_reshard_after_forward = "never"); the key
is checked against the data-parallel degree. The 2-rank run is tests/distributed/test_grad_accumulation.py."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.distributed._accumulation_worker import compare, run
from torchtitan_glm.config import ConfigError, load_config


def _run(tmp_path, name: str, *extra: str):
    out = run(str(tmp_path / name), *extra)
    dist.destroy_process_group()
    return out


def test_two_microbatches_equal_one_batch_of_two_rows(tmp_path, world_of_one):
    whole = _run(tmp_path, "whole", "--training.local_batch_size", "2")
    split = _run(tmp_path, "split", "--training.local_batch_size", "1", "--training.global_batch_size", "2")
    held = _run(tmp_path, "held", "--training.local_batch_size", "1", "--training.global_batch_size", "2",
                "--parallelism.fsdp_reshard_after_forward", "never")
    plans = [(r["plan"].steps, r["plan"].defer_fsdp_reduce, r["plan"].hold_gathered) for r in (whole, split, held)]
    assert plans == [(1, False, False), (2, True, False), (2, True, True)]
    compare(split, whole)
    compare(held, whole)


def test_global_batch_size_is_checked():
    cfg = load_config(["--config", "train_configs/debug_model.toml", "--training.local_batch_size", "2",
                       "--training.global_batch_size", "6"])
    assert cfg.training.accumulation_steps(1) == 3
    assert cfg.training.tokens_per_step(1) == cfg.training.seq_len * 6  # 3 microbatches of 2 rows
    with pytest.raises(ConfigError, match=r"training\.global_batch_size.*multiple of local_batch_size x the "
                                          r"data-parallel degree = 2 x 2 = 4, got 6"):
        cfg.training.accumulation_steps(2)
    with pytest.raises(ConfigError, match=r"training\.global_batch_size"):
        load_config(["--config", "train_configs/debug_model.toml", "--training.global_batch_size", "0"])
    assert load_config(["--config", "train_configs/debug_model.toml"]).training.accumulation_steps(4) == 1


def test_the_planner_counts_microbatches():
    """A step of 4 microbatches: 4x the model's work and tokens, one optimizer step, FSDP2's copies per microbatch
    for gathers and once for the reduce (one GPU: nothing split), once in all under "never" (held between them); the
    gradients held through a later microbatch's forward."""
    from torchtitan_glm.planner import Request, plan
    from torchtitan_glm.planner.hardware import H200

    argv = ("--config", "train_configs/glm5_3_flash_proxy.toml")
    plans = [plan(Request((*argv, *extra), 1, H200, "train")) for extra in ((), ("--training.global_batch_size", "4"))]
    one, four = (p.time for p in plans)
    # memory: a later microbatch runs its forward with the step's FP32 gradients already held
    assert plans[1].memory.peak > plans[0].memory.peak
    assert plans[1].memory.breakdown["gradients"] >= plans[1].memory.state.grads
    assert four.tokens_per_step == 4 * one.tokens_per_step
    for term, seconds in one.compute_s.items():
        if term == "optimizer":
            assert four.compute_s[term] == pytest.approx(seconds)
        elif term != "fsdp_copies":
            assert four.compute_s[term] == pytest.approx(4 * seconds), term
    assert one.compute_s["fsdp_copies"] < four.compute_s["fsdp_copies"] < 4 * one.compute_s["fsdp_copies"]
    never = ("--parallelism.fsdp_reshard_after_forward", "never")
    one_n, four_n = (plan(Request((*argv, *never, *extra), 1, H200, "train")).time
                     for extra in ((), ("--training.global_batch_size", "4")))
    assert four_n.compute_s["fsdp_copies"] == pytest.approx(one_n.compute_s["fsdp_copies"])
    assert four_n.tokens_per_s > four.tokens_per_s > one.tokens_per_s


def test_a_resumed_accumulating_run_repeats_the_uninterrupted_one(tmp_path, world_of_one):
    """4 steps of 2 microbatches, checkpointed at 2 and 4; resumed from step 2, steps 3-4 repeat bit for bit (the
    loader's position counts every microbatch's rows)."""
    import shutil

    from torchtitan_glm.train import Trainer

    argv = ["--config", "train_configs/debug_model.toml", "--training.seq_len", "64", "--training.steps", "4",
            "--training.local_batch_size", "1", "--training.global_batch_size", "2", "--checkpoint.interval", "2",
            "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "1",
            f"--job.dump_folder={tmp_path}"]
    first = Trainer(load_config(argv)).train()
    dist.destroy_process_group()
    shutil.rmtree(tmp_path / "checkpoint" / "step-4")
    again = Trainer(load_config(argv)).train()
    assert len(first) == 4 and again == first[2:]
