"""Decode caches, one per layer type: filled by a block's `prefill`, advanced by its `decode` (models/glm5/decode.py).

Each row of a batch is one prompt; every cache indexes a row's tokens by their position in that prompt (left
padding is never stored), so rows of different lengths advance together, each at its own position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KDACache:
    """A KDA layer: the recurrent state and the short convolutions' inputs of the last W - 1 tokens."""

    state: torch.Tensor  # [B, H, K, V] FP32
    conv: list[torch.Tensor]  # q, k, v projections of the last W - 1 tokens, oldest first, each [B, W - 1, H * K]


@dataclass
class IndexerCache:
    """A KPool indexer: pooled keys of the closed pools, written only when a pool closes (its kpool-th token), and
    the open pool's per-token keys and gate logits. Pools start at each prompt's first token."""

    pooled: torch.Tensor  # [B, ceil(capacity / kpool), D]: pool j covers positions j*kpool .. j*kpool + kpool - 1
    keys: torch.Tensor  # [B, kpool, D] normalised keys of the open pool, slot = position % kpool
    gates: torch.Tensor  # [B, kpool, D] their compression-gate logits


@dataclass
class MLACache:
    """A DSA layer: the normalised kv latent of every token (absorbed MLA reads it as key and value), and the
    indexer's cache (None for a layer that reuses the previous layer's selection)."""

    latent: torch.Tensor  # [B, capacity, kv_lora_rank]
    indexer: IndexerCache | None


@dataclass
class DecodeState:
    """The whole model's decode state: one cache per decoder layer and each row's next position."""

    layers: list[KDACache | MLACache]
    pos: torch.Tensor  # [B] int64: the position (within its prompt) the row's next token takes
    capacity: int  # tokens each row's caches hold
    longest: int  # an upper bound of pos on the host (checked against capacity without a device sync)
