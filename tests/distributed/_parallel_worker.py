"""torchrun worker for test_parallelize.py: BF16 FSDP2 with FP32-kept parameters on 2 gloo ranks; with argument
`tp`, BF16 tensor parallel 2 instead (the per-head FP32 parameters then FP32 DTensor shards)."""

import sys

import torch
import torch.distributed as dist

from torchtitan_glm.components.loss import indexer_kl_loss
from torchtitan_glm.distributed.parallel_dims import ParallelDims
from torchtitan_glm.models.glm5 import Glm5Model, get_flavor
from torchtitan_glm.models.glm5.kda import KDADecay, ShortConv
from torchtitan_glm.models.glm5.mhc import HyperConnection
from torchtitan_glm.config import ParallelismConfig
from torchtitan_glm.models.glm5.parallelize import parallelize_glm5
from torchtitan_glm.components.errors import exit_now


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tp = 2 if "tp" in sys.argv else 1
    dims = ParallelDims.from_config(ParallelismConfig(tensor_parallel_degree=tp), world_size=world)
    meshes = dims.build_mesh("cpu")
    torch.manual_seed(0)
    model = Glm5Model(get_flavor("debug"))
    sync = parallelize_glm5(model, meshes=meshes, param_dtype="bfloat16", reduce_dtype="float32", ac_mode="none",
                                  compile_enable=False)
    replicated = sync.params
    with torch.no_grad():  # pretend the ranks initialised the replicated parameters differently
        for p in replicated:
            p.add_(rank)
    sync.broadcast()
    seen: dict[str, torch.dtype] = {}
    layer = model.layers["0"]

    def record(key: str, attr: str):
        def hook(module, args) -> None:  # a pre-hook must return None, or it replaces the inputs
            seen.setdefault(key, getattr(module, attr).dtype)
        return hook

    layer.attn_hc.register_forward_pre_hook(record("hc_fn", "fn"))
    layer.self_attn.decay.register_forward_pre_hook(record("A_log", "A_log"))
    layer.self_attn.q_proj.register_forward_pre_hook(record("q_proj", "weight"))
    kept = set(replicated)
    opt = torch.optim.AdamW([p for p in model.parameters() if p not in kept], lr=1e-2)
    opt_rep = torch.optim.AdamW(replicated, lr=1e-2)
    gen = torch.Generator().manual_seed(100 + meshes["dp"].get_local_rank())  # different data on each dp rank
    for _ in range(3):
        tokens = torch.randint(0, 512, (2, 32), generator=gen)
        labels = torch.roll(tokens, -1, 1)
        out = model(tokens, labels=labels, token_scale=1.0 / labels.numel(), mtp_scale=0.1 / labels.numel(),
                    indexer_kl="dense")
        (out.loss + indexer_kl_loss(out.indexer_stats)).backward()
        sync.allreduce_grads()
        opt.step()
        opt_rep.step()
        opt.zero_grad()
        opt_rep.zero_grad()
    assert seen == {"hc_fn": torch.float32, "A_log": torch.float32, "q_proj": torch.bfloat16}, seen
    kinds = {type(m) for p in replicated for m in model.modules() if any(q is p for q in m.parameters(recurse=False))}
    assert HyperConnection in kinds and KDADecay in kinds
    DTensor = torch.distributed.tensor.DTensor
    assert all(p.dtype == torch.float32 for p in replicated)
    sharded = {type(m) for m in model.modules() for p in m.parameters(recurse=False) if p in kept and
               isinstance(p, DTensor)}
    assert sharded == (set() if tp == 1 else {KDADecay, ShortConv}), sharded
    assert all(p.placements[0].is_shard(0) for p in replicated if isinstance(p, DTensor))
    flat = torch.cat([p.detach().reshape(-1) for p in replicated if not isinstance(p, DTensor)])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(g, gathered[0]) for g in gathered), "replicated FP32 parameters diverged across ranks"
    # The inference entry runs under FSDP2 too (registered as an FSDP forward method): the same logits on every
    # rank for the same tokens, and equal to the training entry's CE on them.
    tokens = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = model.logits(tokens)
        ce = model(tokens, torch.roll(tokens, -1, 1)).ce
    want = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), torch.roll(tokens, -1, 1).flatten(),
                                             reduction="none").view_as(ce)
    assert logits.shape == (1, 24, 512) and torch.allclose(ce, want, rtol=2e-2, atol=2e-2), (ce - want).abs().max()
    every = [torch.empty_like(logits) for _ in range(world)]
    dist.all_gather(every, logits.contiguous())
    assert all(torch.equal(g, every[0]) for g in every)
    print(f"rank {rank} OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    exit_now(main() or 0)  # no interpreter teardown after the process group is gone (see exit_now)
