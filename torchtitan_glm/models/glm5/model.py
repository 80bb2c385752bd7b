"""Glm5Model: embed -> mHC streams -> 45 decoder layers -> stream contraction -> norm -> LM head, plus MTP."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .args import Glm5ModelArgs
from .decoder import DecoderLayer
from .dsa import DocLayout, IndexerStats
from .layers import RMSNorm, init_linear
from .mhc import LearnedHcHead, mean_hc_head
from .moe import MoEStats
from .mtp import MTPLayer
from .seqinfo import cu_seqlens_to_doc_ids, doc_positions


class Glm5Output(NamedTuple):
    """Final hidden states without the full-vocab logits (the trainer's chunked loss applies lm_head itself)."""

    hidden: torch.Tensor  # [B, T, D] after the final norm
    mtp_hidden: torch.Tensor | None  # [B, T, D] MTP states (predict token t+2) after shared_head.norm
    moe_stats: list[MoEStats]  # one per MoE layer, trunk layers first, then MTP
    indexer_stats: list[IndexerStats]  # one per full-indexer DSA layer when requested, trunk first, then MTP


class Glm5Model(nn.Module):
    """GLM-5.3-Flash text model. `model(tokens, cu_seqlens=None)` -> logits [B, T, vocab]."""

    def __init__(self, args: Glm5ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, padding_idx=args.pad_token_id)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(args, i) for i in range(args.num_hidden_layers)})
        if args.hc_head == "learned":
            self.hc_head = LearnedHcHead(hidden_size=args.hidden_size, hc_mult=args.hc_mult, hc_eps=args.hc_eps,
                                         norm_eps=args.rms_norm_eps)
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.mtp = MTPLayer(args) if args.num_nextn_predict_layers == 1 else None
        self.init_weights()

    # ------------------------------------------------------------------ forward
    def forward(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor | None = None, *,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(self.hidden_states(tokens, cu_seqlens, doc_ids=doc_ids, with_mtp=False).hidden)

    def hidden_states(
        self,
        tokens: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        *,
        doc_ids: torch.Tensor | None = None,
        with_mtp: bool = True,
        collect_indexer_stats: bool = False,
        seq_aux: bool = False,
    ) -> Glm5Output:
        """Run the trunk (and MTP). Packed documents come as cu_seqlens for a [1, total] batch, or as per-token
        document ids [B, T]; KDA state, short convs, indexer pools and attention all restart at boundaries."""
        bsz, seqlen = tokens.shape
        if cu_seqlens is not None:
            if doc_ids is not None:
                raise ValueError("pass either cu_seqlens or doc_ids, not both")
            if bsz != 1:
                raise ValueError(f"cu_seqlens needs a packed [1, total] batch, got tokens of shape {tuple(tokens.shape)}")
            doc_ids = cu_seqlens_to_doc_ids(cu_seqlens, seqlen)
        doc = DocLayout(*doc_positions(doc_ids, bsz, seqlen, tokens.device))
        embeds = self.embed_tokens(tokens)
        streams = embeds.unsqueeze(-2).expand(bsz, seqlen, self.args.hc_mult, -1).contiguous()
        moe_stats: list[MoEStats] = []
        indexer_stats: list[IndexerStats] = []
        prev_mask = None
        for layer in self.layers.values():
            streams, mask, stats, mstats = layer(streams, doc, doc_ids, prev_mask, collect_indexer_stats, seq_aux)
            prev_mask = mask if mask is not None else prev_mask
            if stats is not None:
                indexer_stats.append(stats)
            if mstats is not None:
                moe_stats.append(mstats)
        contracted = self.hc_head(streams) if self.args.hc_head == "learned" else mean_hc_head(streams)
        hidden = self.norm(contracted)
        mtp_hidden = None
        if with_mtp and self.mtp is not None:
            next_embeds = self.embed_tokens(torch.roll(tokens, shifts=-1, dims=1))
            mtp_hidden, stats, mstats = self.mtp(hidden, next_embeds, doc, collect_indexer_stats, seq_aux)
            moe_stats.append(mstats)
            if stats is not None:
                indexer_stats.append(stats)
        return Glm5Output(hidden, mtp_hidden, moe_stats, indexer_stats)

    # --------------------------------------------------------------------- init
    @torch.no_grad()
    def init_weights(self) -> None:
        """Reference init: Linear/Embedding/experts/router N(0, initializer_range), norms 1, mHC fn N(0, .02) base 0
        scale 1, KPool gate 1 and APE 0, A_log/dt_bias by the FLA convention. Meta tensors make this a no-op."""
        std = self.args.initializer_range
        nn.init.normal_(self.embed_tokens.weight, mean=0.0, std=std)
        if self.embed_tokens.padding_idx is not None:
            self.embed_tokens.weight[self.embed_tokens.padding_idx].zero_()
        for layer in self.layers.values():
            layer.init_weights()
        if self.args.hc_head == "learned":
            self.hc_head.init_weights()
        self.norm.init_weights()
        init_linear(self.lm_head, std=std)
        if self.mtp is not None:
            self.mtp.init_weights()


def count_params(model: Glm5Model) -> tuple[int, int]:
    """(total, active per token) parameter counts; buffers (router bias) excluded, embeddings included.

    Active counts the shared expert and num_experts_per_tok of the routed experts of each MoE layer.
    """
    args = model.args
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - routed + routed * args.num_experts_per_tok // args.n_routed_experts
    return total, active
