"""One GLM-5 decoder layer: mHC around (KDA | DSA) attention and (dense | MoE) MLP."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from .args import DSA, Glm5ModelArgs
from .batch import BatchLayout
from .cache import KDACache, MLACache
from .dsa import IndexerStats, SparseMLA
from .kda import KimiDeltaAttention
from .layers import DenseMLP, RMSNorm
from .mhc import HyperConnection
from .moe import MoE, MoEStats


class LayerOutput(NamedTuple):
    """A decoder layer's results: the new streams, the DSA token indices it used (for a following 'shared' layer),
    its indexer KL and its MoE routing statistics (None where the layer has none)."""

    streams: torch.Tensor
    indices: torch.Tensor | None
    indexer_stats: IndexerStats | None
    moe_stats: MoEStats | None


class DecoderLayer(nn.Module):
    """streams [B, T, n, D] -> streams; returns the DSA token indices (for a following 'shared' layer) and stats."""

    def __init__(self, args: Glm5ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.is_dsa = args.layer_types[layer_idx] == DSA
        self.is_moe = args.mlp_layer_types[layer_idx] == "sparse"
        # Only a 'shared' DSA layer reads the previous selection; the others get None, so every layer of one kind
        # compiles to the same graph wherever it sits.
        self.shares_indices = self.is_dsa and args.indexer_types[layer_idx] == "shared"
        hc = dict(hidden_size=args.hidden_size, hc_mult=args.hc_mult, sinkhorn_iters=args.hc_sinkhorn_iters,
                  hc_eps=args.hc_eps, norm_eps=args.rms_norm_eps, fp32_mixing=args.mhc_fp32_mixing)
        self.attn_hc = HyperConnection(**hc)
        self.ffn_hc = HyperConnection(**hc)
        self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if self.is_dsa:
            self.self_attn = SparseMLA(args, shared_indexer=args.indexer_types[layer_idx] == "shared")
        else:
            self.self_attn = KimiDeltaAttention(args)
        if self.is_moe:
            self.mlp = MoE(args)
        else:
            self.mlp = DenseMLP(args.hidden_size, args.intermediate_size, swiglu_limit=args.swiglu_limit)
        self.init_std = args.initializer_range

    def forward(self, streams: torch.Tensor, batch: BatchLayout,
                shared_indices: torch.Tensor | None = None) -> LayerOutput:
        """streams [B, T, n, D]; shared_indices: the previous DSA layer's selection, for an indexer_types 'shared'
        layer."""

        def attend(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, IndexerStats | None]:
            if self.is_dsa:
                return self.self_attn(h, batch, shared_indices)
            return self.self_attn(h, batch), None, None

        return self._sites(streams, attend, seq_aux=batch.seq_aux)

    def _sites(self, streams: torch.Tensor, attend: Callable, *, seq_aux: bool) -> LayerOutput:
        """The layer around its token mixer: attend(h) -> (output, indices, indexer stats) at the attention site."""
        post, comb, h = self.attn_hc(streams)
        h, indices, stats = attend(self.input_layernorm(h))
        streams = self.attn_hc.merge(streams, h, post, comb)

        post, comb, h = self.ffn_hc(streams)
        h = self.post_attention_layernorm(h)
        moe_stats = None
        if self.is_moe:
            h, moe_stats = self.mlp(h, seq_aux=seq_aux)
        else:
            h = self.mlp(h)
        streams = self.ffn_hc.merge(streams, h, post, comb)
        return LayerOutput(streams, indices, stats, moe_stats)

    # ------------------------------------------------------------------ decode (models/glm5/decode.py)
    def prefill(self, streams: torch.Tensor, batch: BatchLayout, shared_indices: torch.Tensor | None = None, *,
                capacity: int) -> tuple[LayerOutput, KDACache | MLACache]:
        """forward() over rows that each end with a prompt, and this layer's decode cache after them."""
        caches = []

        def attend(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None]:
            if self.is_dsa:
                out, indices, cache = self.self_attn.prefill(h, batch, shared_indices, capacity=capacity)
            else:
                (out, cache), indices = self.self_attn.prefill(h, batch), None
            caches.append(cache)
            return out, indices, None

        return self._sites(streams, attend, seq_aux=False), caches[0]

    def decode(self, streams: torch.Tensor, cache: KDACache | MLACache, pos: torch.Tensor,
               shared_indices: torch.Tensor | None = None) -> LayerOutput:
        """One token per row (streams [B, 1, n, D]) at prompt positions pos [B], advancing `cache`."""

        def attend(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None]:
            if self.is_dsa:
                return (*self.self_attn.decode(h, cache, pos, shared_indices), None)
            return self.self_attn.decode(h, cache, pos), None, None

        return self._sites(streams, attend, seq_aux=False)

    def init_weights(self) -> None:
        self.attn_hc.init_weights()
        self.ffn_hc.init_weights()
        self.input_layernorm.init_weights()
        self.post_attention_layernorm.init_weights()
        self.self_attn.init_weights()
        if self.is_moe:
            self.mlp.init_weights()
        else:
            self.mlp.init_weights(std=self.init_std)
