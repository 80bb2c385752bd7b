"""torchrun worker of test_replicated_grads.py (2 gloo ranks, FSDP2, fp32): the gradients of the parameters kept
out of FSDP2, averaged by the bucketed all-reduces that overlap with backward, equal one process's gradients on
the whole global batch; with AVG and with the SUM + multiply fallback; and a sum in place of the average fails the
same comparison (the check is sensitive to it).  usage: _replicated_grads_worker.py"""

import copy

import torch
import torch.distributed as dist

from torchtitan_glm.components import loss as losses
from torchtitan_glm.config import ParallelismConfig
from torchtitan_glm.distributed import replicated as rep_mod
from torchtitan_glm.distributed.parallel_dims import ParallelDims
from torchtitan_glm.models.glm5 import Glm5Model, get_flavor
from torchtitan_glm.models.glm5.parallelize import parallelize_glm5
from torchtitan_glm.components.errors import exit_now

ROWS, T = 4, 32


def batch(step: int):
    gen = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, 512, (ROWS, T), generator=gen)
    labels = torch.roll(tokens, -1, 1)
    labels[:, -1] = -100
    labels[1, :7] = -100  # rows with different token counts: the global token mean is not a mean of rank means
    return tokens, labels


def loss_of(model, tokens, labels, *, dp: int, group) -> torch.Tensor:
    (count,) = losses.global_token_counts(labels, group=group)
    scale = losses.token_scale(count, dp_size=dp)
    return model(tokens, labels=labels, token_scale=scale, mtp_scale=0.1 * scale).loss


def max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dims = ParallelDims.from_config(ParallelismConfig(), world_size=world)
    meshes = dims.build_mesh("cpu")
    dp_group = meshes["dp_cp"].get_group()
    torch.manual_seed(0)
    ref = Glm5Model(get_flavor("debug"))
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    results = {}
    for mode in ("avg", "sum_then_scale", "sum_only"):
        model = copy.deepcopy(ref)
        if mode != "avg":  # the fallback path (gloo without AVG), and a deliberately wrong sum
            rep_mod_avg, rep_mod.avg_supported = rep_mod.avg_supported, lambda group: False
        sync = parallelize_glm5(model, meshes=meshes, param_dtype="float32", reduce_dtype="float32", ac_mode="none",
                                compile_enable=False, bucket_bytes=4096)
        if mode != "avg":
            rep_mod.avg_supported = rep_mod_avg
        if mode == "sum_only":
            for b in sync.buckets:
                b.scale = 1.0
        assert len(sync.buckets) > 3, f"{len(sync.buckets)} buckets: the 4 KiB cap should split them"
        assert all(b.avg == (mode == "avg") for b in sync.buckets), [b.avg for b in sync.buckets]
        kept = {id(p) for p in sync.params}
        names = [n for n, p in model.named_parameters() if id(p) in kept and p.requires_grad]
        tokens, labels = batch(0)
        loss_of(model, tokens[rows], labels[rows], dp=dims.dp, group=dp_group).backward()
        # every bucket whose gradients all arrived started its all-reduce during backward (without the indexer
        # KL the indexer's parameters get none: their buckets start in allreduce_grads)
        complete = [all(p.grad is not None for p in b.params) for b in sync.buckets]
        assert sum(complete) >= 3 and [b.work is not None for b in sync.buckets] == complete, complete
        sync.allreduce_grads()
        assert all(b.work is None and b.ready == 0 for b in sync.buckets)
        results[mode] = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                         if n in names and p.grad is not None}

    ref_model = copy.deepcopy(ref)
    tokens, labels = batch(0)
    alone = dist.new_group([rank])
    loss_of(ref_model, tokens, labels, dp=1, group=alone).backward()
    want = {n: p.grad for n, p in ref_model.named_parameters() if n in results["avg"]}
    assert len(want) > 20, sorted(want)
    for mode in ("avg", "sum_then_scale"):
        errs = {n: max_rel_err(results[mode][n], want[n]) for n in want}
        worst = max(errs, key=errs.get)
        assert errs[worst] <= 1e-5, f"{mode}: {worst} relative error {errs[worst]:.2e}"
    errs = {n: max_rel_err(results["sum_only"][n], want[n]) for n in want}
    assert min(errs.values()) > 0.5, "a sum of the ranks' gradients passed the comparison with the average"
    print(f"rank {rank} OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    exit_now(main() or 0)  # no interpreter teardown after the process group is gone (see exit_now)
