"""One GLM-5 decoder layer: mHC around (KDA | DSA) attention and (dense | MoE) MLP."""

from __future__ import annotations

import torch
from torch import nn

from .args import DSA, Glm5ModelArgs
from .dsa import DocLayout, IndexerStats, SparseMLA
from .kda import KimiDeltaAttention
from .layers import DenseMLP, RMSNorm
from .mhc import HyperConnection
from .moe import MoE, MoEStats


class DecoderLayer(nn.Module):
    """streams [B, T, n, D] -> streams; returns the DSA token indices (for a following 'shared' layer) and stats."""

    def __init__(self, args: Glm5ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.is_dsa = args.layer_types[layer_idx] == DSA
        self.is_moe = args.mlp_layer_types[layer_idx] == "sparse"
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

    def forward(
        self,
        streams: torch.Tensor,
        doc: DocLayout,
        doc_ids: torch.Tensor | None = None,
        shared_indices: torch.Tensor | None = None,
        indexer_kl: str | None = None,
        seq_aux: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, IndexerStats | None, MoEStats | None]:
        post, comb, h = self.attn_hc(streams)
        h = self.input_layernorm(h)
        indices, stats = None, None
        if self.is_dsa:
            h, indices, stats = self.self_attn(h, doc=doc, shared_indices=shared_indices, indexer_kl=indexer_kl)
        else:
            h = self.self_attn(h, doc_ids=doc_ids, pos_in_doc=None if doc_ids is None else doc.pos)
        streams = self.attn_hc.merge(streams, h, post, comb)

        post, comb, h = self.ffn_hc(streams)
        h = self.post_attention_layernorm(h)
        moe_stats = None
        if self.is_moe:
            h, moe_stats = self.mlp(h, seq_aux=seq_aux)
        else:
            h = self.mlp(h)
        streams = self.ffn_hc.merge(streams, h, post, comb)
        return streams, indices, stats, moe_stats

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
