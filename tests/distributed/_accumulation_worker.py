"""torchrun worker of test_grad_accumulation.py (2 gloo ranks, FSDP2 over both, fp32): two microbatches of one row
per rank accumulate the first step's gradients of one batch of two rows per rank, FSDP2 reduce-scattering after
each microbatch and the replicated parameters' all-reduce deferred to the last, also under expert and context
parallelism; after two steps the losses, parameters and router biases agree too. Prints "rank <r> OK". `run` and
`compare` also serve the one-rank test (tests/unit/test_grad_accumulation.py).  usage: _accumulation_worker.py"""

import os
import tempfile
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from torchtitan_glm.components.errors import exit_now
from torchtitan_glm.config import load_config

_BASE = ["--config", "train_configs/debug_model.toml", "--training.seq_len", "64", "--training.steps", "2",
         "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "1",
         "--lr_scheduler.warmup_steps", "1", "--compile.enable", "false", "--loss.indexer_kl_coeff", "0"]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def run(folder: str, *extra: str) -> dict[str, Any]:
    """Two training steps: the accumulation plan, the losses, the first step's gradients (after the clip, as the
    optimizer sees them) and parameters before it, the parameters and router biases at the end."""
    from torchtitan_glm.train import Trainer

    trainer = Trainer(load_config([*_BASE, *extra, f"--job.dump_folder={folder}"]))
    first: dict[str, dict[str, torch.Tensor]] = {}
    named = list(trainer.model.named_parameters())

    def keep(*_):
        if not first:  # full_tensor is a collective: every rank gathers the same tensors in the same order
            first["grads"] = {n: _full(p.grad) for n, p in named if p.grad is not None}
            first["params"] = {n: _full(p) for n, p in named}

    trainer.optimizer.register_step_pre_hook(keep)
    losses = trainer.train()
    return dict(plan=trainer.accumulation, losses=losses, buckets=len(trainer.replicated.buckets), **first,
                final={n: _full(p) for n, p in named},
                biases={n: b.clone() for n, b in trainer.model.named_buffers()
                        if n.endswith("e_score_correction_bias")})


def compare(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Accumulated against whole: losses to 1e-5; gradients to FP32 round-off of the sums (1e-5 of the tensor's
    largest element); each parameter's two-step update to 1e-3 of its size (Adam divides round-off in a near-zero
    gradient by that gradient's own size, so single elements may move apart by more than round-off); biases exactly
    the same steps."""
    torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=0)
    assert got["grads"].keys() == want["grads"].keys() and len(want["grads"]) > 100
    for name, value in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], value, rtol=1e-5, atol=1e-5 * value.abs().max().item(),
                                   msg=name)
    moved = 0
    for name, value in want["final"].items():
        update = (value - want["params"][name]).norm()
        assert (got["final"][name] - value).norm() <= 1e-3 * update, name  # unchanged ones (no gradient) stay equal
        moved += bool(update > 0)
    assert moved > 100, moved
    assert want["biases"]
    for name, value in want["biases"].items():
        torch.testing.assert_close(got["biases"][name], value, msg=name)


def main() -> None:
    folder = tempfile.mkdtemp()
    whole = run(folder, "--training.local_batch_size", "2")
    split = run(folder, "--training.local_batch_size", "1", "--training.global_batch_size", "4")
    held = run(folder, "--training.local_batch_size", "1", "--training.global_batch_size", "4",
               "--parallelism.fsdp_reshard_after_forward", "never")
    assert whole["buckets"] > 0, "the replicated parameters' all-reduces are bucketed (the path no_sync holds back)"
    plans = [(r["plan"].steps, r["plan"].defer_fsdp_reduce, r["plan"].hold_gathered) for r in (whole, split, held)]
    assert plans == [(1, False, False), (2, False, False), (2, False, True)], plans
    compare(split, whole)
    compare(held, whole)
    # expert parallelism: the experts' tokens cross ranks in every microbatch's all-to-all; their gradients (outside
    # FSDP2) accumulate and are reduced once
    ep = ("--parallelism.expert_parallel_degree", "2")
    ep_whole = run(folder, *ep, "--training.local_batch_size", "2")
    ep_split = run(folder, *ep, "--training.local_batch_size", "1", "--training.global_batch_size", "4")
    assert (ep_split["plan"].steps, ep_split["plan"].defer_fsdp_reduce) == (2, False)
    compare(ep_split, ep_whole)
    # context parallelism: both ranks read the same rows (dp = 1), each microbatch's rows split over them
    cp = ("--parallelism.context_parallel_degree", "2")
    cp_whole = run(folder, *cp, "--training.local_batch_size", "2")
    cp_split = run(folder, *cp, "--training.local_batch_size", "1", "--training.global_batch_size", "2")
    assert cp_split["plan"].steps == 2
    compare(cp_split, cp_whole)
    # replicas only (FSDP2's reduce is a copy, then an all-reduce over the replicas): deferred to the last
    # microbatch, here with FSDP2's buffers from the compute stream's pool (parallelism.fsdp_reduce_in_compute_pool)
    rep = ("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1")
    rep_whole = run(folder, *rep, "--training.local_batch_size", "2")
    rep_split = run(folder, *rep, "--training.local_batch_size", "1", "--training.global_batch_size", "4",
                    "--parallelism.fsdp_reduce_in_compute_pool", "true")
    assert (rep_split["plan"].steps, rep_split["plan"].defer_fsdp_reduce) == (2, True)
    compare(rep_split, rep_whole)
    print(f"rank {os.environ['RANK']} OK", flush=True)


if __name__ == "__main__":
    exit_now(main() or 0)
