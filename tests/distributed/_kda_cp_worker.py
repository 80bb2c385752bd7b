"""torchrun worker for test_kda_cp.py: KDA and its short convolution under context parallelism (gloo, zigzag and
contiguous slots) against the whole rows on one rank, forward and gradients, documents crossing rank boundaries."""

import gc

import torch
import torch.distributed as dist

from torchtitan_glm.distributed.cp_layout import CPLayout
from torchtitan_glm.models.glm5.kda import ShortConv
from torchtitan_glm.models.glm5.seqinfo import doc_positions
from torchtitan_glm.ops.kda import kda_reference
from torchtitan_glm.ops.kda_cp import conv_halo, kda_cp
from torchtitan_glm.components.errors import exit_now

H, K, V, T = 2, 8, 6, 64


def doc_ids_for(lengths_per_row):
    return torch.stack([torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls)) for ls in lengths_per_row])


def inputs(seed, gate):
    gen = torch.Generator().manual_seed(seed)
    b = 3
    q, k = torch.randn(b, T, H, K, generator=gen), torch.randn(b, T, H, K, generator=gen)
    v = torch.randn(b, T, H, V, generator=gen)
    g = -5.0 * torch.rand(b, T, H, K, generator=gen) if gate == "uniform" else \
        torch.nn.functional.logsigmoid(torch.randn(b, T, H, K, generator=gen) + 2)
    beta = torch.rand(b, T, H, generator=gen)
    do = torch.randn(b, T, H, V, generator=gen)
    return [q, k, v, g, beta], do


def local_slots(layout, cp, rank, x, dim=1):
    """This rank's part in the contiguous layout (slot `rank` of cp equal slots)."""
    n = x.shape[dim] // cp
    return x.narrow(dim, rank * n, n)


def check(name, got, want, tol=2e-5):
    err = (got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-12)
    assert torch.isfinite(got).all() and err < tol, f"{name}: rel err {err:.2e}"


def main() -> None:
    dist.init_process_group("gloo")
    checks(dist.get_rank(), dist.get_world_size(), dist.group.WORLD)
    # every autograd graph that holds the group is gone before it is destroyed: with them alive, a rank sometimes
    # aborted at exit ("terminate called without an active exception", 1 run in 4 at 4 ranks on 2 cores)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def checks(rank: int, cp: int, group: dist.ProcessGroup) -> None:
    # documents of uneven lengths crossing slot (T / 2cp) and rank boundaries; row 1 is one document; row 2 has a
    # document starting exactly at a slot start and a 1-token document
    doc_ids = doc_ids_for([[13, 3, 30, 18], [64], [8, 24, 1, 31]])
    pos_in_doc = doc_positions(doc_ids, doc_ids.shape[0], T, doc_ids.device)[0]
    for layout in ("zigzag", "contiguous"):
        shard = (lambda x, d=1: CPLayout(cp, rank).shard(x, dim=d)) if layout == "zigzag" else \
            (lambda x, d=1: local_slots(layout, cp, rank, x, d))
        for gate, seed in (("uniform", 0), ("logsigmoid", 1)):
            xs, do = inputs(seed, gate)
            for ids in (doc_ids, None):
                full = [x.clone().requires_grad_(True) for x in xs]
                ref = kda_reference(*full, ids)
                ref_grads = torch.autograd.grad(ref, full, do)
                local = [shard(x).detach().clone().requires_grad_(True) for x in xs]
                out = kda_cp(*local, None if ids is None else shard(ids), group=group, layout=layout, safe_gate=True)
                grads = torch.autograd.grad(out, local, shard(do))
                tag = f"{layout}/{gate}/{'docs' if ids is not None else 'rows'}"
                check(f"{tag} o", out, shard(ref.detach()))
                for n, a, e in zip(("dq", "dk", "dv", "dg", "dbeta"), grads, ref_grads):
                    check(f"{tag} {n}", a, shard(e))
        # short conv: halo from the previous slot, taps masked by the global position in document
        conv = ShortConv(12, 4)
        torch.manual_seed(3)
        conv.init_weights(std=0.5)
        x = torch.randn(3, T, 12, requires_grad=True)
        dy = torch.randn(3, T, 12)
        ref = conv(x, pos_in_doc)
        gx, gw = torch.autograd.grad(ref, (x, conv.weight), dy)
        xl = shard(x.detach()).requires_grad_(True)
        halo = conv_halo(xl, 4, group=group, layout=layout)
        out = conv(xl, shard(pos_in_doc), halo)
        gxl, gwl = torch.autograd.grad(out, (xl, conv.weight), shard(dy))
        dist.all_reduce(gwl)  # the weight's gradient is a sum over ranks (the tokens are split)
        check(f"{layout} conv y", out, shard(ref.detach()), 1e-6)
        check(f"{layout} conv dx", gxl, shard(gx), 1e-6)
        check(f"{layout} conv dw", gwl, gw, 1e-5)
    # the layout's differentiable unshard: all ranks' parts back to the contiguous rows
    layout = CPLayout(cp, rank)
    x = torch.randn(3, T, 5, generator=torch.Generator().manual_seed(7))
    xl = layout.shard(x).requires_grad_(True)
    full = layout.unshard(xl, group=group)
    assert torch.equal(full, x)
    (gx,) = torch.autograd.grad((full * torch.arange(T).view(1, T, 1)).sum(), xl)
    assert torch.equal(gx, cp * layout.shard(torch.arange(T).view(1, T, 1).expand_as(x)).float())
    print(f"rank {rank} OK", flush=True)


if __name__ == "__main__":
    exit_now(main() or 0)  # no interpreter teardown after the process group is gone (see exit_now)
