"""Document layout of a (possibly packed) batch, as static-shape tensors derived from per-token document ids."""

from __future__ import annotations

import torch


def cu_seqlens_to_doc_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[N+1] cumulative lengths of packed documents -> [1, total] int64 document id per token."""
    cu = cu_seqlens.to(torch.long)
    if cu.ndim != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != total:
        raise ValueError(f"cu_seqlens must be 1-D, start at 0 and end at the packed length {total}; got {cu.tolist()}")
    if bool((cu[1:] <= cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must be strictly increasing; got {cu.tolist()}")
    pos = torch.arange(total, device=cu.device)
    return torch.searchsorted(cu[1:], pos, right=True).unsqueeze(0)


def doc_positions(doc_ids: torch.Tensor | None, batch: int, seqlen: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pos_in_doc, doc_len, doc_key), each [B, T] int64; doc_key is equal iff two tokens share a document.

    Without doc_ids every row is one document. Static shapes, no host sync: safe inside compiled blocks.
    """
    pos = torch.arange(seqlen, device=device).expand(batch, seqlen)
    if doc_ids is None:
        length = torch.full((batch, seqlen), seqlen, device=device, dtype=torch.long)
        return pos, length, torch.zeros(batch, seqlen, device=device, dtype=torch.long)
    ids = doc_ids.to(torch.long)
    is_start = torch.ones_like(ids, dtype=torch.bool)
    is_start[:, 1:] = ids[:, 1:] != ids[:, :-1]
    is_end = torch.ones_like(ids, dtype=torch.bool)
    is_end[:, :-1] = ids[:, 1:] != ids[:, :-1]
    start = torch.where(is_start, pos, torch.zeros_like(pos)).cummax(dim=1).values
    end_marker = torch.where(is_end, pos, torch.full_like(pos, seqlen))
    end = end_marker.flip(1).cummin(dim=1).values.flip(1)
    return pos - start, end - start + 1, start
