"""torchrun worker for test_cp_model.py: the debug model under context parallelism (the row zigzag over the whole
world) computes the loss, indexer KL and gradients of one process on the same rows: packed documents that cross the
ranks' chunk boundaries, KDA state chained across ranks, DSA over the all-gathered latent and pooled keys."""

import copy
import sys

import torch
import torch.distributed as dist

from torchtitan_glm.components.loss import indexer_kl_loss
from torchtitan_glm.distributed.cp_layout import CPLayout
from torchtitan_glm.models.glm5 import Glm5Model, get_flavor
from torchtitan_glm.models.glm5.batch import train_batch
from torchtitan_glm.components.errors import exit_now


def close(name, got, want, tol=2e-5, floor=1e-8):
    err = (got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(floor)
    assert torch.isfinite(got).all() and err <= tol, f"{name}: rel err {err:.2e}"


def main() -> None:
    kl_mode = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    torch.manual_seed(0)
    args = get_flavor("debug")
    if "dense_dsa" in sys.argv:  # the selection attended through masked SDPA: rows <= dsa_dense_max_len
        args = args.replace(dsa_dense_max_len=1 << 20)
    model = Glm5Model(args)  # fp32, replicated: the test sums the ranks' gradients itself
    ref = copy.deepcopy(model)
    bsz, seqlen = 2, 64
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 512, (bsz, seqlen), generator=gen)
    doc_ids = torch.stack([torch.repeat_interleave(torch.arange(n), torch.tensor(lengths)) for n, lengths in
                           ((3, [13, 30, 21]), (2, [41, 23]))])
    labels = torch.roll(tokens, -1, 1)
    ends = torch.ones_like(doc_ids, dtype=torch.bool)
    ends[:, :-1] = doc_ids[:, 1:] != doc_ids[:, :-1]
    labels = labels.masked_fill(ends, -100)

    batch = train_batch(tokens, labels, doc_ids, cp=(group, CPLayout(size=world, rank=rank)))
    counts = torch.stack([(batch.labels != -100).sum(), (batch.mtp_labels != -100).sum()]).float()
    dist.all_reduce(counts)
    out = model(batch, token_scale=1.0 / counts[0], mtp_scale=0.1 / counts[1], indexer_kl=kl_mode)
    kl = indexer_kl_loss(out.indexer_stats, group=group)
    (out.loss + kl).backward()

    want = ref(tokens, labels, doc_ids=doc_ids, token_scale=1.0 / counts[0], mtp_scale=0.1 / counts[1],
               indexer_kl=kl_mode)
    want_kl = indexer_kl_loss(want.indexer_stats)
    (want.loss + want_kl).backward()

    sums = torch.stack([out.loss.detach(), kl.detach()])
    dist.all_reduce(sums)
    close("CE + MTP", sums[0], want.loss.detach(), 1e-6)
    # the KL is a difference of near-equal log-probabilities (~1e-4 here): compare on the scale of those
    close("indexer KL", sums[1], want_kl.detach(), 1e-6, floor=1e-2)
    ref_params = dict(ref.named_parameters())
    peak = max(p.grad.abs().max() for p in ref.parameters() if p.grad is not None)
    for name, p in model.named_parameters():
        want_g = ref_params[name].grad
        if want_g is None:
            assert p.grad is None or p.grad.abs().max() == 0, name
            continue
        g = p.grad.clone()
        dist.all_reduce(g)
        err = (g - want_g).abs().max()
        assert err <= 2e-5 * want_g.abs().max() + 1e-3 * peak * 1e-2, f"grad {name}: {err:.2e}"
    print(f"rank {rank} OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now(0)  # no interpreter teardown after the process group is gone (see exit_now)
