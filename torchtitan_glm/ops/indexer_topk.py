"""KPool indexer scores and top-k pool selection in query tiles: O(tile x P) working memory, never [T, P, heads].

Score of query t for pool p: I(t, p) = sum_h w[t, h] * relu(q[t, h] . pk[p] * d^-1/2) (w already carries the
H^-1/2 factor). A pool is a candidate for query t when it is complete, in t's document and its last token is <= t:
callers pass pool_last [B, P] (last token of each slot; >= T for unused slots), pool_key [B, P] and doc_key [B, T]
(equal keys = same document). Slots come in token order, slot p starting at or after token kpool * p, so queries
below t1 only ever see slots p < t1 // kpool: each tile scores only those.

Selection: the top k candidates by score, ties broken towards the earlier pool (what a stable descending sort
gives), as pool slots [B, T, k] int64 in that order, -1 where fewer than k pools are candidates.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["index_scores", "kpool_topk", "query_tiles", "tile_rows", "visible"]

_INT64_MIN = -(2**63)
_LOW = 2**31 - 1


def tile_rows(width: int, budget: int) -> int:
    """Query rows per tile so that one [rows, width] working tensor holds at most `budget` elements."""
    return max(1, budget // max(1, width))


def query_tiles(bsz: int, seqlen: int, num_slots: int, *, tile: int, kpool: int, offset: int = 0):
    """(row b, first query t0, end t1, slots W) of each query tile that can see a pool: queries below t1 only ever
    see slots < t1 // kpool (module docstring). Query i sits at row position offset + i."""
    for b in range(bsz):
        for t0 in range(0, seqlen, tile):
            t1 = min(t0 + tile, seqlen)
            width = min(num_slots, (offset + t1) // kpool)
            if width > 0:
                yield b, t0, t1, width


def index_scores(q: Tensor, w: Tensor, pk: Tensor) -> tuple[Tensor, Tensor]:
    """(I [n, W], relu'd per-head scores [n, H, W]) for q [n, H, d], w [n, H], pk [W, d]; in q's dtype. No autograd
    (in-place on the [n, H, W] tile)."""
    r = torch.matmul(q, pk.t()).mul_(q.shape[-1] ** -0.5).relu_()
    return torch.matmul(w.unsqueeze(-2), r).squeeze(-2), r


def visible(pool_last: Tensor, pool_key: Tensor, doc_key: Tensor, t0: int) -> Tensor:
    """[n, W] candidates for the queries t0 .. t0 + n - 1 of one row (pool_last, pool_key [W]; doc_key [n])."""
    t = torch.arange(t0, t0 + doc_key.shape[0], device=doc_key.device)
    return (pool_last[None, :] <= t[:, None]) & (pool_key[None, :] == doc_key[:, None])


def _stable_topk(scores: Tensor, valid: Tensor, k: int) -> Tensor:
    """Top-k columns of each row among `valid`, ties towards the lower column, in descending order; -1 pads.

    One int64 key per entry, (order-preserving int32 of the FP32 score) << 32 | (2^31 - 1 - column), makes every key
    unique, so torch.topk (whose tie order is unspecified) returns exactly a stable sort's first k.
    """
    s = scores.float() + 0.0  # + 0.0 turns -0.0 into +0.0: they tie in a float sort
    bits = s.view(torch.int32)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long()
    col = torch.arange(s.shape[-1], device=s.device)
    key = (ordered << 32) | (_LOW - col)
    key = key.masked_fill(~valid, _INT64_MIN)
    top = key.topk(min(k, s.shape[-1]), dim=-1, sorted=True).values
    return torch.where(top != _INT64_MIN, _LOW - (top & 0xFFFFFFFF), -1)


def kpool_topk_tiled(
    q: Tensor, w: Tensor, pk: Tensor, pool_last: Tensor, pool_key: Tensor, doc_key: Tensor, *,
    k: int, kpool: int, tile: int, q_start: int = 0,
) -> Tensor:
    """Selected pool slots [B, T, k] int64 (see module docstring); q [B, T, H, d], w [B, T, H], pk [B, P, d];
    doc_key [B, S] covers the whole row, query i sits at position q_start + i (context parallelism: a rank's chunk)."""
    bsz, seqlen = q.shape[:2]
    num_slots = pk.shape[1]
    out = torch.full((bsz, seqlen, k), -1, dtype=torch.long, device=q.device)
    if k == 0:
        return out
    for b, t0, t1, width in query_tiles(bsz, seqlen, num_slots, tile=tile, kpool=kpool, offset=q_start):
        scores, _ = index_scores(q[b, t0:t1], w[b, t0:t1], pk[b, :width])
        valid = visible(pool_last[b, :width], pool_key[b, :width], doc_key[b, q_start + t0:q_start + t1],
                        q_start + t0)
        top = _stable_topk(scores, valid, k)
        out[b, t0:t1, : top.shape[-1]] = top
    return out


@torch.library.custom_op("torchtitan_glm::kpool_topk", mutates_args=())
def kpool_topk(
    q: Tensor, w: Tensor, pk: Tensor, pool_last: Tensor, pool_key: Tensor, doc_key: Tensor, k: int, kpool: int,
    tile: int, q_start: int = 0,
) -> Tensor:
    """Tiled top-k pool selection (module docstring); the same torch code on every device. No gradient."""
    with torch.no_grad():
        return kpool_topk_tiled(q, w, pk, pool_last, pool_key, doc_key, k=k, kpool=kpool, tile=tile, q_start=q_start)


@kpool_topk.register_fake
def _kpool_topk_fake(q, w, pk, pool_last, pool_key, doc_key, k, kpool, tile, q_start=0):
    return q.new_empty(q.shape[0], q.shape[1], k, dtype=torch.long)
