"""Glm5Model: embed -> mHC streams -> 45 decoder layers -> stream contraction -> norm -> LM head, plus MTP."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .args import Glm5ModelArgs
from .decoder import DecoderLayer
from .dsa import DocLayout, IndexerStats
from .layers import LMHead, RMSNorm
from .mhc import LearnedHcHead, mean_hc_head
from .moe import MoEStats
from .mtp import MTPLayer
from .seqinfo import cu_seqlens_to_doc_ids, doc_positions


class Glm5Output(NamedTuple):
    """Final hidden states without the full-vocab logits (the trainer's chunked loss applies lm_head itself)."""

    hidden: torch.Tensor  # [B, T, D] after the final norm
    mtp_hidden: torch.Tensor | None  # [B, T, D] MTP states (predict token t+2) after shared_head.norm
    moe_stats: list[MoEStats]  # one per MoE layer, trunk layers first, then MTP
    indexer_stats: list[IndexerStats]  # KL of each full-indexer DSA layer when requested, trunk first, then MTP


class Glm5LossOutput(NamedTuple):
    """Training forward: the scaled loss to backpropagate and what the trainer logs and balances with."""

    loss: torch.Tensor  # differentiable scalar: sum of scaled CE and MTP-CE
    ce: torch.Tensor  # [B, T] per-token CE (FP32, 0 where ignored), no grad
    mtp_ce: torch.Tensor | None  # [B, T] per-token MTP CE, no grad
    moe_stats: list[MoEStats]
    indexer_stats: list[IndexerStats]


def mtp_targets(labels: torch.Tensor) -> torch.Tensor:
    """MTP labels: position t predicts labels[t + 1] when both t and t + 1 are real next-token targets."""
    nxt = torch.roll(labels, shifts=-1, dims=1)
    nxt[:, -1] = -100
    return nxt.masked_fill(labels == -100, -100)


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
        self.lm_head = LMHead(args.hidden_size, args.vocab_size)
        self.mtp = MTPLayer(args) if args.num_nextn_predict_layers == 1 else None
        self.init_weights()

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        tokens: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        *,
        doc_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        token_scale: float | torch.Tensor = 1.0,
        mtp_scale: float | torch.Tensor = 0.0,
        collect_indexer_stats: bool = False,
        indexer_sparse_loss: bool = False,
        seq_aux: bool = False,
        ce_chunk_size: int = 4096,
    ) -> torch.Tensor | Glm5LossOutput:
        """Without labels: logits [B, T, vocab]. With labels [B, T] (-100 = ignore): the training loss
        sum_t token_scale * CE_t + mtp_scale * MTP-CE_t, computed in chunks from the hidden states, plus stats.

        The MTP at position t predicts labels[t + 1] (token t + 2) and is ignored where labels[t] or
        labels[t + 1] is (document ends, the row's last position). mtp_scale == 0 skips the MTP layer.
        collect_indexer_stats: each DSA layer with an indexer computes its KL (loss.indexer_kl_loss sums them), over
        the selected pools with indexer_sparse_loss, else over every candidate pool.
        """
        with_mtp = labels is not None and self.mtp is not None and bool(mtp_scale != 0)
        out = self.hidden_states(tokens, cu_seqlens, doc_ids=doc_ids, with_mtp=with_mtp,
                                 collect_indexer_stats=collect_indexer_stats, indexer_sparse_loss=indexer_sparse_loss,
                                 seq_aux=seq_aux)
        if labels is None:
            return self.lm_head(out.hidden)
        hidden, targets = out.hidden.flatten(0, 1), labels.flatten()
        scales = torch.full_like(targets, 1, dtype=torch.float32) * token_scale
        if with_mtp:
            mtp_labels = mtp_targets(labels)
            hidden = torch.cat([hidden, out.mtp_hidden.flatten(0, 1)])
            targets = torch.cat([targets, mtp_labels.flatten()])
            scales = torch.cat([scales, torch.full_like(mtp_labels.flatten(), 1, dtype=torch.float32) * mtp_scale])
        loss, per_token = self.lm_head(hidden, targets, scales, chunk_size=ce_chunk_size)
        n = labels.numel()
        ce = per_token[:n].view_as(labels).clone()  # clones: no view outputs across the FSDP2 root
        mtp = per_token[n:].view_as(labels).clone() if with_mtp else None
        return Glm5LossOutput(loss, ce, mtp, out.moe_stats, out.indexer_stats)

    def hidden_states(
        self,
        tokens: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        *,
        doc_ids: torch.Tensor | None = None,
        with_mtp: bool = True,
        collect_indexer_stats: bool = False,
        indexer_sparse_loss: bool = False,
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
        kl = ("sparse" if indexer_sparse_loss else "dense") if collect_indexer_stats else None
        prev_indices = None
        for layer in self.layers.values():
            streams, indices, stats, mstats = layer(streams, doc, doc_ids, prev_indices, kl, seq_aux)
            prev_indices = indices if indices is not None else prev_indices
            if stats is not None:
                indexer_stats.append(stats)
            if mstats is not None:
                moe_stats.append(mstats)
        contracted = self.hc_head(streams) if self.args.hc_head == "learned" else mean_hc_head(streams)
        hidden = self.norm(contracted)
        mtp_hidden = None
        if with_mtp and self.mtp is not None:
            next_embeds = self.embed_tokens(torch.roll(tokens, shifts=-1, dims=1))
            mtp_hidden, stats, mstats = self.mtp(hidden, next_embeds, doc, kl, seq_aux)
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
        self.lm_head.init_weights(std=std)
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
