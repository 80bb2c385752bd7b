"""The context-parallel layout: the one place that knows which tokens of a [B, T] batch each cp rank holds.

Zigzag (head-tail): each row is cut into 2*cp equal chunks and rank r holds chunks r and 2*cp-1-r, in that order,
so causal work is balanced. Packed documents simply cross chunk boundaries (KDA carries its state across them,
attention sees the all-gathered prefix); this is the layout FLA's KDA context parallelism implements
(`fla.ops.cp.build_cp_context(..., layout="zigzag")`). The per-document variant cuts every document into 2*cp
chunks instead (each document length must divide by 2*cp): it balances attention over many short documents, but
FLA's KDA chain does not support it, so models with KDA layers use the row zigzag.

The index generation wraps torch's context-parallel load balancers
(`torch.distributed.tensor.experimental._context_parallel._load_balancer`: `_HeadTailLoadBalancer`,
`_PerDocumentHeadTailLoadBalancer`; present in torch 2.13; expected in 2.11 (added by pytorch PR #161062 in 2025,
then moved into this package; not checked on a 2.11 install, the import also tries the older location). They are
private; if an import fails the same indices come from `_fallback_*` below, and the tests assert both agree. torch
2.13's per-document balancer is document-major (see torch_per_document_is_rank_major), so there the fallback is used.

Versions: torch 2.13 (CI) checked here; torch 2.11 (GPU) not checked. FLA: fla-core 0.6.0's `fla.ops.cp`
(`build_cp_context(..., layout="zigzag")`, `chunk_kda_fwd/bwd(cp_context=...)`), imported lazily by ops/kda_cp.py
on CUDA only; `tests/unit/test_cp_layout.py` checks our local cu_seqlens against FLA's where FLA imports (triton).

Index convention (torch's): `indices` [R, T] (R = 1 or B) is rank-major: positions [r*T/cp, (r+1)*T/cp) are the
global token positions rank r holds, in its local order; `x_zigzag = x.gather(1, indices)`, and `restore` (its
argsort) undoes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["CPLayout", "LAYOUTS", "doc_lengths", "head_tail_indices", "per_document_indices"]

LAYOUTS = ("zigzag", "zigzag_per_document")


def _torch_balancers():
    """torch's (private) CP load balancer classes, or None where this torch lacks them."""
    try:
        from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
            _HeadTailLoadBalancer, _PerDocumentHeadTailLoadBalancer,
        )
    except ImportError:
        try:  # torch 2.9 kept them one level up
            from torch.distributed.tensor.experimental._load_balancer import (
                _HeadTailLoadBalancer, _PerDocumentHeadTailLoadBalancer,
            )
        except ImportError:
            return None
    return _HeadTailLoadBalancer, _PerDocumentHeadTailLoadBalancer


def _fallback_head_tail(seq_len: int, cp: int) -> Tensor:
    chunks = torch.arange(seq_len).view(2 * cp, seq_len // (2 * cp))
    ranks = torch.arange(cp)
    return torch.stack([chunks[ranks], chunks[2 * cp - 1 - ranks]], 1).reshape(-1)


def _fallback_per_document(lengths: list[int], cp: int) -> Tensor:
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    per_doc = [_fallback_head_tail(n, cp).view(cp, -1) + start for start, n in zip(starts, lengths)]
    return torch.cat(per_doc, 1).reshape(-1)  # rank-major; per rank each document's head and tail, in order


def head_tail_indices(seq_len: int, cp: int, *, use_torch: bool = True) -> Tensor:
    """[1, T] int64 rank-major zigzag indices of one row (torch's `_HeadTailLoadBalancer`)."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x cp = {2 * cp}")
    balancers = _torch_balancers() if use_torch else None
    if balancers is None:
        return _fallback_head_tail(seq_len, cp).unsqueeze(0)
    return balancers[0](seq_len, cp, "cpu")._generate_indices().long()


def torch_per_document_is_rank_major() -> bool:
    """Whether this torch's `_PerDocumentHeadTailLoadBalancer` lays its indices out rank-major. torch 2.13 (and
    2.11) emit them document-major (each document's rank-0 pair, rank-1 pair, ..., then the next document), so a
    contiguous per-rank slice cuts mid-document and loses the balance its docstring shows; upstream pytorch later
    made it rank-major (the version at commit 19cc90d8). We use torch's only where it is rank-major."""
    balancers = _torch_balancers()
    if balancers is None:
        return False
    probe = [[4, 8]]
    return torch.equal(balancers[1](probe, 2, "cpu")._generate_indices().long()[0], _fallback_per_document(probe[0], 2))


def per_document_indices(lengths: list[list[int]], cp: int, *, use_torch: bool = True) -> Tensor:
    """[B, T] int64 rank-major per-document head-tail indices (torch's `_PerDocumentHeadTailLoadBalancer` where it
    is rank-major, see torch_per_document_is_rank_major); lengths[b] = the document lengths of row b, each divisible
    by 2 x cp."""
    for b, row in enumerate(lengths):
        bad = [n for n in row if n % (2 * cp)]
        if bad:
            raise ValueError(f"per-document zigzag needs every document length divisible by 2 x cp = {2 * cp}; "
                             f"row {b} has documents of length {bad}")
    if not (use_torch and torch_per_document_is_rank_major()):
        return torch.stack([_fallback_per_document(row, cp) for row in lengths])
    return _torch_balancers()[1](lengths, cp, "cpu")._generate_indices().long()


def doc_lengths(doc_ids: Tensor) -> list[list[int]]:
    """Run lengths of equal document ids per row of doc_ids [B, T] (host sync: data-side use)."""
    out = []
    for row in doc_ids.to("cpu", torch.int64):
        cut = (torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist()
        bounds = [0, *cut, row.numel()]
        out.append([e - s for s, e in zip(bounds[:-1], bounds[1:])])
    return out


def _gather_rows(x: Tensor, idx: Tensor, dim: int) -> Tensor:
    """x [B, T, ...] (T at `dim`, B at 0) reordered along dim by idx [1 or B, T'] per row."""
    dim = dim % x.ndim
    if idx.shape[0] == 1:
        return x.index_select(dim, idx[0].to(x.device, non_blocking=True))
    if dim != 1:
        raise ValueError("per-row (per-document) indices need the sequence at dim 1 and the batch at dim 0")
    shape = (idx.shape[0], idx.shape[1]) + (1,) * (x.ndim - 2)
    return x.gather(1, idx.to(x.device, non_blocking=True).view(shape).expand(idx.shape[0], idx.shape[1], *x.shape[2:]))


@dataclass(frozen=True)
class CPLayout:
    """Rank `rank` of a context-parallel group of `size`; `per_document` picks the per-document zigzag.

    Methods that need the document structure take the *global* doc_ids [B, T] (per-token document ids, equal only
    within a document, as the data loader makes them)."""

    size: int
    rank: int
    per_document: bool = False

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"context-parallel rank {self.rank} is not in a group of {self.size}")

    @property
    def name(self) -> str:
        return LAYOUTS[int(self.per_document)]

    # ------------------------------------------------------------------ indices
    def indices(self, seq_len: int, *, doc_ids: Tensor | None = None) -> Tensor:
        """[1 or B, T] rank-major global positions (see module docstring)."""
        if not self.per_document:
            return head_tail_indices(seq_len, self.size)
        if doc_ids is None:
            raise ValueError("the per-document zigzag needs doc_ids")
        return per_document_indices(doc_lengths(doc_ids), self.size)

    def local_positions(self, seq_len: int, *, doc_ids: Tensor | None = None) -> Tensor:
        """[1 or B, T/cp] global positions (row index of the token) of this rank's tokens, in local order."""
        local = seq_len // self.size
        return self.indices(seq_len, doc_ids=doc_ids)[:, self.rank * local:(self.rank + 1) * local]

    # ------------------------------------------------------------------ tensors
    def to_zigzag(self, x: Tensor, *, dim: int = 1, doc_ids: Tensor | None = None) -> Tensor:
        """Contiguous [B, T, ...] -> every rank's local part, concatenated rank-major along dim."""
        return _gather_rows(x, self.indices(x.shape[dim], doc_ids=doc_ids), dim)

    def from_zigzag(self, x: Tensor, *, dim: int = 1, doc_ids: Tensor | None = None) -> Tensor:
        """Inverse of to_zigzag (exact: a permutation)."""
        restore = torch.argsort(self.indices(x.shape[dim], doc_ids=doc_ids), dim=-1)
        return _gather_rows(x, restore, dim)

    def shard(self, x: Tensor, *, dim: int = 1, doc_ids: Tensor | None = None) -> Tensor:
        """This rank's part of a contiguous [B, T, ...] tensor (T at dim)."""
        return _gather_rows(x, self.local_positions(x.shape[dim], doc_ids=doc_ids), dim)

    def unshard(self, local: Tensor, *, group: dist.ProcessGroup, dim: int = 1,
                doc_ids: Tensor | None = None) -> Tensor:
        """All ranks' parts back to the contiguous [B, T, ...] tensor (an all-gather; differentiable: the
        gradient of each rank's part is the sum over ranks). doc_ids: the global ones, for the per-document
        layout."""
        from torchtitan_glm.distributed.collectives import all_gather_autograd

        gathered = all_gather_autograd(local.contiguous(), dim=dim, group=group)
        return self.from_zigzag(gathered, dim=dim, doc_ids=doc_ids)

    # ------------------------------------------------------------------ documents
    def chunk_ids(self, seq_len: int, *, doc_ids: Tensor | None = None) -> Tensor:
        """[1 or B, T] global id of the zigzag chunk holding each token (2*cp chunks per row, or per document)."""
        if not self.per_document:
            return (torch.arange(seq_len) // (seq_len // (2 * self.size))).unsqueeze(0)
        from torchtitan_glm.models.glm5.seqinfo import doc_positions

        ids = doc_ids.to("cpu", torch.long)
        pos, length, _ = doc_positions(ids, ids.shape[0], seq_len, ids.device)
        ordinal = (pos == 0).long().cumsum(1) - 1
        return ordinal * 2 * self.size + pos // (length // (2 * self.size))

    def local_pieces(self, seq_len: int, *, doc_ids: Tensor | None = None) -> list[list[tuple[int, int]]]:
        """Per row of `indices` (1 row for the row zigzag, which every row shares; B for the per-document one), this
        rank's chunks as global intervals [start, end), in local order."""
        pos = self.local_positions(seq_len, doc_ids=doc_ids)
        chunk = self.shard(self.chunk_ids(seq_len, doc_ids=doc_ids), doc_ids=doc_ids)
        rows = []
        for p, ch in zip(pos, chunk):
            cut = (torch.nonzero(ch[1:] != ch[:-1]).flatten() + 1).tolist()
            bounds = [0, *cut, ch.numel()]
            rows.append([(int(p[s]), int(p[e - 1]) + 1) for s, e in zip(bounds[:-1], bounds[1:])])
        return rows

    def local_segment_ids(self, doc_ids: Tensor) -> Tensor:
        """[B, T/cp] int64 ids of this rank's tokens that change at every local restart of a recurrence: a new
        document or a new chunk (chunks are chained across ranks, never locally)."""
        local_doc = self.shard(doc_ids, doc_ids=doc_ids)
        chunk = self.shard(self.chunk_ids(doc_ids.shape[1], doc_ids=doc_ids), doc_ids=doc_ids)
        chunk = chunk.to(local_doc.device).expand_as(local_doc)
        restart = torch.ones_like(local_doc, dtype=torch.bool)
        restart[:, 1:] = (local_doc[:, 1:] != local_doc[:, :-1]) | (chunk[:, 1:] != chunk[:, :-1])
        return restart.long().cumsum(1) - 1

    def local_cu_seqlens(self, doc_ids: Tensor) -> Tensor:
        """int32 cumulative lengths of the local restart segments over the flattened [1, B*T/cp] local buffer
        (row starts, document starts and chunk starts): FLA's rank-local cu_seqlens for the row zigzag."""
        seg = self.local_segment_ids(doc_ids)
        seg = seg + torch.arange(seg.shape[0], device=seg.device).view(-1, 1) * (seg.shape[1] + 1)  # rows restart
        start = torch.ones(seg.numel(), dtype=torch.bool, device=seg.device)
        flat = seg.flatten()
        start[1:] = flat[1:] != flat[:-1]
        begins = torch.nonzero(start).flatten()
        return torch.cat([begins, begins.new_tensor([flat.numel()])]).to(torch.int32)

    def local_pos_in_doc(self, doc_ids: Tensor) -> Tensor:
        """[B, T/cp] position of each local token inside its (global) document."""
        from torchtitan_glm.models.glm5.seqinfo import doc_positions

        pos, _, _ = doc_positions(doc_ids, doc_ids.shape[0], doc_ids.shape[1], doc_ids.device)
        return self.shard(pos, doc_ids=doc_ids)
