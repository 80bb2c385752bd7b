"""Glm5Model: embed -> mHC streams -> 45 decoder layers -> stream contraction -> norm -> LM head, plus MTP."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from torch import nn

from .args import Glm5ModelArgs
from .batch import TrainBatch, batch_layout, mtp_targets, train_batch  # noqa: F401  (mtp_targets: re-exported)
from .decoder import DecoderLayer
from .dsa import IndexerStats
from .layers import LMHead, RMSNorm
from .mhc import LearnedHcHead, mean_hc_head
from .moe import MoEStats
from .mtp import MTPLayer
from .seqinfo import cu_seqlens_to_doc_ids


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


class Glm5Model(nn.Module):
    """GLM-5.3-Flash text model: `model(batch)` trains (Glm5LossOutput), `model.logits(tokens)` infers."""

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
        # activation_checkpoint.HostOffload when [activation_checkpoint] offload_inputs (set by
        # apply_activation_checkpointing): each block call runs under its saved-tensor hooks
        self.block_offload = None
        self.init_weights()

    # ------------------------------------------------------------------ entries
    def forward(
        self,
        tokens: torch.Tensor | TrainBatch,
        labels: torch.Tensor | None = None,
        *,
        doc_ids: torch.Tensor | None = None,
        token_scale: float | torch.Tensor = 1.0,
        mtp_scale: float | torch.Tensor = 0.0,
        indexer_kl: str | None = None,
        seq_aux: bool = False,
        ce_chunk_size: int = 4096,
    ) -> Glm5LossOutput:
        """The training entry: sum_t token_scale * CE_t + mtp_scale * MTP-CE_t, computed in chunks from the hidden
        states (the logits never exist whole), plus the statistics the trainer balances and logs.

        `tokens` is a TrainBatch (models/glm5/batch.py; what the trainer passes, sharded for context parallelism),
        or whole rows [B, T] with `labels` [B, T] (-100 = ignore) and optional per-token `doc_ids`. The MTP at
        position t predicts labels[t + 1] (token t + 2); it runs whenever the model has an MTP layer (its weight is
        mtp_scale). indexer_kl: None, "sparse" or "dense" (each DSA layer computes its KL over that support; see
        components/loss.indexer_kl_loss). Inference: `logits()`."""
        if isinstance(tokens, TrainBatch):
            batch = tokens
        elif labels is None:
            raise TypeError("Glm5Model.forward is the training entry and needs labels; use model.logits(tokens) for "
                            "logits")
        else:
            batch = train_batch(tokens, labels, doc_ids)
        with_mtp = self.mtp is not None
        out = self.hidden_states(batch.tokens, doc_ids=batch.doc_ids, with_mtp=with_mtp, indexer_kl=indexer_kl,
                                 seq_aux=seq_aux, next_tokens=batch.next_tokens, cp=batch.cp,
                                 host_doc_ids=None if batch.host_doc_ids is None else batch.host_doc_ids.ids)
        labels = batch.labels
        hidden, targets = out.hidden.flatten(0, 1), labels.flatten()
        scales = torch.full_like(targets, 1, dtype=torch.float32) * token_scale
        if with_mtp:
            hidden = torch.cat([hidden, out.mtp_hidden.flatten(0, 1)])
            targets = torch.cat([targets, batch.mtp_labels.flatten()])
            scales = torch.cat([scales, torch.full_like(targets[labels.numel():], 1, dtype=torch.float32)
                                * mtp_scale])
        loss, per_token = self.lm_head(hidden, targets, scales, chunk_size=ce_chunk_size)
        n = labels.numel()
        ce = per_token[:n].view_as(labels).clone()  # clones: no view outputs across the FSDP2 root
        mtp = per_token[n:].view_as(labels).clone() if with_mtp else None
        return Glm5LossOutput(loss, ce, mtp, out.moe_stats, out.indexer_stats)

    def logits(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor | None = None, *,
               doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The inference entry: logits [B, T, vocab] of the trunk (no MTP). Packed documents as cu_seqlens for a
        [1, total] batch, or per-token doc_ids [B, T]."""
        return self.lm_head(self.hidden_states(tokens, cu_seqlens, doc_ids=doc_ids, with_mtp=False).hidden)

    def hidden_states(
        self,
        tokens: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        *,
        doc_ids: torch.Tensor | None = None,
        with_mtp: bool = True,
        indexer_kl: str | None = None,
        seq_aux: bool = False,
        next_tokens: torch.Tensor | None = None,
        cp: tuple | None = None,
        host_doc_ids: torch.Tensor | None = None,
    ) -> Glm5Output:
        """Run the trunk (and MTP). Packed documents come as cu_seqlens for a [1, total] batch, or as per-token
        document ids [B, T]; KDA state, short convs, indexer pools and attention all restart at boundaries.

        Under context parallelism (`cp` = (group, CPLayout)) `tokens` and `next_tokens` are this rank's part and
        `doc_ids` the whole rows' document ids. next_tokens: the MTP's input tokens (default: tokens rolled by one).
        host_doc_ids: `doc_ids` on the host, when the caller has them there (no device-to-host copy in KDA)."""
        bsz, local_len = tokens.shape
        if cu_seqlens is not None:
            if doc_ids is not None:
                raise ValueError("pass either cu_seqlens or doc_ids, not both")
            if bsz != 1:
                raise ValueError("cu_seqlens needs a packed [1, total] batch, got tokens of shape "
                                 f"{tuple(tokens.shape)}")
            doc_ids = cu_seqlens_to_doc_ids(cu_seqlens, local_len)
        seqlen = local_len * (1 if cp is None else cp[1].size)
        batch = batch_layout(doc_ids, (bsz, seqlen), tokens.device, cp=cp, indexer_kl=indexer_kl, seq_aux=seq_aux,
                             host_doc_ids=host_doc_ids)
        embeds = self.embed_tokens(tokens)
        streams = embeds.unsqueeze(-2).expand(bsz, local_len, self.args.hc_mult, -1).contiguous()
        moe_stats: list[MoEStats] = []
        indexer_stats: list[IndexerStats] = []
        prev_indices = None
        offload = self.block_offload if torch.is_grad_enabled() else None
        for layer in self.layers.values():
            shared = prev_indices if layer.shares_indices else None
            with offload.hooks() if offload is not None else contextlib.nullcontext():
                streams, indices, stats, mstats = layer(streams, batch, shared)
            prev_indices = indices if indices is not None else prev_indices
            if stats is not None:
                indexer_stats.append(stats)
            if mstats is not None:
                moe_stats.append(mstats)
        contracted = self.hc_head(streams) if self.args.hc_head == "learned" else mean_hc_head(streams)
        hidden = self.norm(contracted)
        mtp_hidden = None
        if with_mtp and self.mtp is not None:
            if next_tokens is None:
                next_tokens = torch.roll(tokens, shifts=-1, dims=1)
            next_embeds = self.embed_tokens(next_tokens)
            with offload.hooks() if offload is not None else contextlib.nullcontext():
                mtp_hidden, stats, mstats = self.mtp(hidden, next_embeds, batch)
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
