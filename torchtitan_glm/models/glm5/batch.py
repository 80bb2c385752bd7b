"""What the layers need to know about a batch besides its activations: one small object instead of positional flags.

`TrainBatch` is a training batch as this rank computes it (tokens, labels and the MTP inputs, sharded by the
context-parallel layout when there is one); `BatchLayout` is what every layer reads: the local tokens' document
coordinates, the context-parallel context, and what to collect (the indexer KL form, the MoE sequence aux loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from torchtitan_glm.distributed.cp_layout import CPLayout

from .seqinfo import doc_positions

IGNORE_INDEX = -100


class DocLayout(NamedTuple):
    """Per-token document coordinates [B, T] (see seqinfo.doc_positions)."""

    pos: Tensor  # position within the document
    length: Tensor  # length of the document
    key: Tensor  # equal iff two tokens share a document (the document's first row position)


class CPContext(NamedTuple):
    """Context parallelism: this rank holds `layout`'s part of every row (distributed/cp_layout.py)."""

    group: dist.ProcessGroup
    layout: CPLayout
    full_doc: DocLayout  # the whole rows' document coordinates [B, T]
    positions: Tensor  # [1 or B, T_local] row position of each local token


class BatchLayout(NamedTuple):
    """Read by every layer. Without context parallelism the local tokens are the whole rows."""

    doc: DocLayout  # the local tokens' coordinates in their (whole) documents
    doc_ids: Tensor | None  # [B, T_local] document id per local token; None = one document per row
    cp: CPContext | None = None
    indexer_kl: str | None = None  # None | "sparse" | "dense": what each DSA layer's indexer KL is computed over
    seq_aux: bool = False  # MoE layers return the sequence-level balance loss
    host_doc_ids: Tensor | None = None  # doc_ids on the host: the loader's, or batch_layout's one copy (KDA's varlen)

    @property
    def kda_seq_idx(self) -> Tensor | None:
        """The document ids KDA's op builds its varlen layout from: the host copy when there is one, so the CUDA
        kernel needs no device-to-host copy (ops/kda.py::_varlen)."""
        return self.host_doc_ids if self.host_doc_ids is not None else self.doc_ids

    @property
    def rows(self) -> int:
        return self.doc.pos.shape[0]


@dataclass(frozen=True)
class HostDocIds:
    """The whole rows' document ids [B, T] on the host, for KDA's varlen layout (ops/kda.py::_varlen). A plain object
    on purpose: FSDP2's root pre-forward copies every tensor it finds in the inputs' tuples, lists and dicts to the
    device, with a blocking copy, and would also lose the host copy."""

    ids: Tensor


class TrainBatch(NamedTuple):
    """A training batch as this rank computes it, every tensor [B, T_local]."""

    tokens: Tensor
    labels: Tensor  # -100 = ignore
    next_tokens: Tensor  # token t + 1 (the MTP layer's embedding input)
    mtp_labels: Tensor  # label of token t + 1 (the MTP target), -100 where labels[t] or labels[t + 1] is ignored
    doc_ids: Tensor | None  # the WHOLE rows' document ids [B, T] (context parallelism needs the whole row)
    cp: tuple[dist.ProcessGroup, CPLayout] | None = None
    host_doc_ids: HostDocIds | None = None  # the same ids on the host, when the batch came from there


def mtp_targets(labels: Tensor) -> Tensor:
    """MTP labels: position t predicts labels[t + 1] when both t and t + 1 are real next-token targets."""
    nxt = torch.roll(labels, shifts=-1, dims=1)
    nxt[:, -1] = IGNORE_INDEX
    return nxt.masked_fill(labels == IGNORE_INDEX, IGNORE_INDEX)


def train_batch(tokens: Tensor, labels: Tensor, doc_ids: Tensor | None = None, *,
                cp: tuple[dist.ProcessGroup, CPLayout] | None = None,
                host_doc_ids: Tensor | None = None) -> TrainBatch:
    """Whole rows [B, T] -> this rank's TrainBatch: the MTP inputs are formed on the whole rows (token t + 1 may live
    on another context-parallel rank), then everything is sharded by the layout. host_doc_ids: `doc_ids` as the
    loader produced them, on the host (the KDA kernels and the zigzag layout then read no device value)."""
    next_tokens = torch.roll(tokens, shifts=-1, dims=1)  # the last one's MTP target is ignored anyway
    mtp_labels = mtp_targets(labels)
    if host_doc_ids is not None and host_doc_ids.device.type != "cpu":
        raise ValueError(f"host_doc_ids must be on the host, got a {host_doc_ids.device} tensor")
    host = None if host_doc_ids is None else HostDocIds(host_doc_ids)
    if cp is None:
        return TrainBatch(tokens, labels, next_tokens, mtp_labels, doc_ids, None, host)
    layout = cp[1]
    if doc_ids is None:  # one document per row; the zigzag layout reads the ids on the host, so make them there too
        doc_ids = torch.zeros_like(tokens)
        host = HostDocIds(torch.zeros(tokens.shape, dtype=torch.long))
    layout_ids = doc_ids if host is None else host.ids
    local = [layout.shard(t, doc_ids=layout_ids) for t in (tokens, labels, next_tokens, mtp_labels)]
    return TrainBatch(*local, doc_ids, cp, host)


def batch_layout(doc_ids: Tensor | None, shape: tuple[int, int], device: torch.device, *,
                 cp: tuple[dist.ProcessGroup, CPLayout] | None = None, indexer_kl: str | None = None,
                 seq_aux: bool = False, host_doc_ids: Tensor | None = None) -> BatchLayout:
    """The BatchLayout of rows of `shape` = (B, T) (whole rows) with per-token `doc_ids` (None: one document per
    row), for this rank's part under context parallelism. host_doc_ids: the same ids on the host (kept for the KDA
    op, and used for the zigzag layout); made here, with one device-to-host copy, when only device ids are given."""
    if indexer_kl not in (None, "sparse", "dense"):
        raise ValueError(f"indexer_kl must be None, 'sparse' or 'dense', got {indexer_kl!r}")
    if host_doc_ids is not None and (doc_ids is None or host_doc_ids.device.type != "cpu"):
        raise ValueError("host_doc_ids must be the host copy of doc_ids")
    bsz, seqlen = shape
    host = host_doc_ids
    if host is None and doc_ids is not None and doc_ids.device.type != "cpu":
        # ids given only on the device (scripts, decode prefill): one blocking copy here, for the whole forward,
        # instead of one per KDA layer and direction (ops/kda.py::_varlen) and per zigzag sharding
        host = doc_ids.cpu()
    doc = DocLayout(*doc_positions(doc_ids, bsz, seqlen, device))
    if cp is None:
        return BatchLayout(doc, doc_ids, None, indexer_kl, seq_aux, host)
    group, layout = cp
    ids = torch.zeros(bsz, seqlen, dtype=torch.long, device=device) if doc_ids is None else doc_ids
    layout_ids = ids if host is None else host  # the zigzag permutation is computed on the host either way
    local_doc = DocLayout(*(layout.shard(t, doc_ids=layout_ids) for t in doc))
    positions = layout.local_positions(seqlen, doc_ids=layout_ids).to(device, non_blocking=True)
    context = CPContext(group, layout, doc, positions)
    local_host = None if host is None else layout.shard(host, doc_ids=host)
    return BatchLayout(local_doc, layout.shard(ids, doc_ids=layout_ids), context, indexer_kl, seq_aux, local_host)
