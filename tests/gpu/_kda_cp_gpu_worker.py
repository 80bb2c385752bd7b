"""torchrun worker for test_kda_cp_fla.py: FLA's CUDA context-parallel KDA path (ops.kda_cp on NCCL, zigzag) against
the fp32 torch reference on the whole rows, forward and gradients, packed documents crossing rank boundaries."""

import os
import sys

import torch
import torch.distributed as dist

from torchtitan_glm.distributed.cp_layout import CPLayout
from torchtitan_glm.ops.kda import kda_reference
from torchtitan_glm.ops.kda_cp import kda_cp

H, D, T = 4, 128, 1024


def main() -> None:
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local % torch.cuda.device_count())
    dist.init_process_group("nccl")
    rank, cp = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k = torch.randn(2, T, H, D, device=dev, generator=gen), torch.randn(2, T, H, D, device=dev, generator=gen)
    v = torch.randn(2, T, H, D, device=dev, generator=gen)
    g = -5.0 * torch.sigmoid(2.0 * torch.randn(2, T, H, D, device=dev, generator=gen))
    beta = torch.rand(2, T, H, device=dev, generator=gen)
    do = torch.randn(2, T, H, D, device=dev, generator=gen)
    lengths = [[100, 300, 17, 607], [T]]
    doc_ids = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths]).to(dev)
    inputs = [q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16()]
    full = [x.float().requires_grad_(True) for x in inputs]
    ref = kda_reference(*full, doc_ids)
    ref_grads = torch.autograd.grad(ref, full, do.float())
    layout = CPLayout(cp, rank)
    xs = [layout.shard(x).detach().clone().requires_grad_(True) for x in inputs]
    out = kda_cp(*xs, layout.shard(doc_ids), group=dist.group.WORLD, layout="zigzag", safe_gate=True)
    grads = torch.autograd.grad(out, xs, layout.shard(do).to(out.dtype))
    # bf16 bounds of tests/gpu/test_kda_fla.py (max |diff| / max |ref|)
    for name, a, e in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), (out, *grads), (ref, *ref_grads)):
        e = layout.shard(e.detach()).float()
        err = ((a.float() - e).abs().max() / e.abs().max()).item()
        print(f"rank {rank} {name}: max-abs ratio {err:.2e}", flush=True)
        assert torch.isfinite(a).all() and err < 6e-2, f"{name}: {err:.2e}"
    print(f"rank {rank} OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
