"""MTP (depth 1): h' = eh_proj([enorm(embed(t+1)); hnorm(h_t)]), one DSA+MoE layer with plain residuals, then
shared_head.norm; the trunk's LM head turns it into logits for token t+2.

h_t is the trunk's final hidden state after its final norm, as Megatron's decoder (final layernorm inside) and
vLLM's MTP drafters feed it.
"""

from __future__ import annotations

import torch
from torch import nn

from .args import Glm5ModelArgs
from .batch import BatchLayout
from .dsa import IndexerStats, SparseMLA
from .layers import RMSNorm, init_linear
from .moe import MoE, MoEStats


class SharedHead(nn.Module):
    """Holds the MTP output norm (checkpoint name `shared_head.norm`); the head itself is the trunk's lm_head."""

    def __init__(self, args: Glm5ModelArgs) -> None:
        super().__init__()
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class MTPLayer(nn.Module):
    linear_roles = {"eh_proj": "mtp"}

    def __init__(self, args: Glm5ModelArgs) -> None:
        super().__init__()
        d = args.hidden_size
        self.init_std = args.initializer_range
        self.enorm = RMSNorm(d, eps=args.rms_norm_eps)
        self.hnorm = RMSNorm(d, eps=args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.input_layernorm = RMSNorm(d, eps=args.rms_norm_eps)
        self.self_attn = SparseMLA(args)
        self.post_attention_layernorm = RMSNorm(d, eps=args.rms_norm_eps)
        self.mlp = MoE(args)
        self.shared_head = SharedHead(args)

    def forward(
        self, hidden: torch.Tensor, next_embeds: torch.Tensor, batch: BatchLayout,
    ) -> tuple[torch.Tensor, IndexerStats | None, MoEStats]:
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        a, _, stats = self.self_attn(self.input_layernorm(x), batch)
        x = x + a
        m, moe_stats = self.mlp(self.post_attention_layernorm(x), seq_aux=batch.seq_aux)
        x = x + m
        return self.shared_head.norm(x), stats, moe_stats

    def init_weights(self) -> None:
        for norm in (self.enorm, self.hnorm, self.input_layernorm, self.post_attention_layernorm,
                     self.shared_head.norm):
            norm.init_weights()
        init_linear(self.eh_proj, std=self.init_std)
        self.self_attn.init_weights()
        self.mlp.init_weights()
