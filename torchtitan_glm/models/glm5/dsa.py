"""DSA block: NoPE MLA whose attention is restricted to the KPool indexer's selection.

The indexer scores pooled keys (kpool consecutive tokens of one document, softmax-weighted per dimension), keeps
the top index_topk // kpool pools visible to each query, expands them to tokens and always adds the query's
incomplete causal tail. Its inputs are detached: it learns only from the indexer KL loss, never from the LM loss.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_glm.ops.masked_attention import masked_attention

from .args import Glm5ModelArgs
from .indexer_fp8 import fp8_serving_input
from .layers import RMSNorm, init_linear


class DocLayout(NamedTuple):
    """Per-token document coordinates [B, T] (see seqinfo.doc_positions)."""

    pos: torch.Tensor
    length: torch.Tensor
    key: torch.Tensor


class PoolLayout(NamedTuple):
    """The complete kpool-token pools of a batch, in at most T // kpool slots per row (static shape)."""

    start: torch.Tensor  # [B, P] first token of each slot (0 for unused slots)
    used: torch.Tensor  # [B, P] bool
    key: torch.Tensor  # [B, P] document key of the pool
    token_slot: torch.Tensor  # [B, T] slot of the complete pool holding each token, -1 if none


class IndexerStats(NamedTuple):
    """What the indexer KL loss needs, per DSA layer; all [B, T, P]."""

    logits: torch.Tensor  # indexer scores (FP32; gradient reaches the indexer parameters only)
    target: torch.Tensor  # main attention's head-summed probability per pool, L1-normalised over `valid`
    valid: torch.Tensor  # pools visible to the query (same document, last token <= query)
    selected: torch.Tensor  # pools the sparse attention used


def pool_layout(doc: DocLayout, kpool: int) -> PoolLayout:
    """Pools restart at every document start; a pool exists only if all its kpool tokens are in the document."""
    bsz, seqlen = doc.pos.shape
    num_slots = seqlen // kpool
    device = doc.pos.device
    tokens = torch.arange(seqlen, device=device).expand(bsz, seqlen)
    is_start = (doc.pos % kpool == 0) & (doc.pos + kpool <= doc.length)
    rank = is_start.long().cumsum(dim=1) - 1
    slot = torch.where(is_start, rank, torch.full_like(rank, num_slots))
    start = torch.zeros(bsz, num_slots + 1, dtype=torch.long, device=device).scatter(1, slot, tokens)[:, :num_slots]
    used = torch.zeros(bsz, num_slots + 1, dtype=torch.bool, device=device).scatter(1, slot, is_start)[:, :num_slots]
    first = tokens - doc.pos % kpool
    complete = doc.pos - doc.pos % kpool + kpool <= doc.length
    token_slot = torch.where(complete, rank.gather(1, first), torch.full_like(rank, -1))
    return PoolLayout(start, used, doc.key.gather(1, start), token_slot)


def causal_doc_mask(doc: DocLayout) -> torch.Tensor:
    """[B, T, T] dense causal mask within documents."""
    seqlen = doc.pos.shape[1]
    t = torch.arange(seqlen, device=doc.pos.device)
    causal = t[None, :, None] >= t[None, None, :]
    return causal & (doc.key[:, :, None] == doc.key[:, None, :])


class KPoolAPE(nn.Module):
    """Per-slot additive position bias of the KPool compression softmax (FP32-kept, as in Megatron PR #7522)."""

    keep_fp32 = True
    no_weight_decay = True

    def __init__(self, kpool: int, head_dim: int, *, trainable: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(kpool, head_dim, dtype=torch.float32), requires_grad=trainable)

    def init_weights(self) -> None:
        nn.init.zeros_(self.weight)


class FP32LayerNorm(nn.LayerNorm):
    """LayerNorm with FP32-kept weight and bias, computed in FP32, one rounding of the output (indexer_k_norm_fp32)."""

    keep_fp32 = True
    no_weight_decay = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), self.bias.float(),
                            self.eps).to(x.dtype)


class KPoolIndexer(nn.Module):
    """Lightning indexer over kpool-pooled keys; returns the per-query token mask of the sparse attention."""

    # Serving runs the indexer in BF16: its projections keep role "indexer" (never FP8).
    linear_roles = {"wq_b": "indexer", "wk": "indexer", "weights_proj": "indexer"}
    no_weight_decay_params = {"index_kpool_compress_gate"}

    def __init__(self, args: Glm5ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.head_dim = args.index_n_heads, args.index_head_dim
        self.kpool = args.index_kpool
        self.select_pools = args.index_topk // args.index_kpool
        self.always_select_tail = args.index_kpool_always_select_tail
        self.init_std = args.initializer_range
        self.fp8_emulation = args.indexer_fp8_emulation
        self.fp32_accumulate = args.kpool_fp32_accumulate
        self.weights_fp32 = args.indexer_weights_fp32
        self.k_norm_fp32 = args.indexer_k_norm_fp32
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.hidden_size, self.head_dim, bias=False)
        self.k_norm = (FP32LayerNorm if self.k_norm_fp32 else nn.LayerNorm)(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(args.hidden_size, self.n_heads, bias=False)
        self.index_kpool_compress_gate = nn.Parameter(torch.empty(self.head_dim, args.hidden_size))
        self.kpool_ape = KPoolAPE(self.kpool, self.head_dim, trainable=args.kpool_ape_trainable)
        # Linears read through their weight, never called: a float8 conversion would not reach them.
        self.weight_only_linears = {"weights_proj"} if self.weights_fp32 else set()

    def pooled_keys(self, x: torch.Tensor, pools: PoolLayout) -> torch.Tensor:
        """[B, P, D] pooled keys: per-dimension softmax over each pool's kpool slots (gate + APE, FP32) weighting the
        normalised keys; summed in the keys' dtype (the reference) or in FP32 with one rounding (kpool_fp32_accumulate)."""
        bsz = x.shape[0]
        k = self.k_norm(self.wk(x))
        gate = F.linear(x, self.index_kpool_compress_gate)
        idx = (pools.start.unsqueeze(-1) + torch.arange(self.kpool, device=x.device)).clamp(max=x.shape[1] - 1)
        rows = torch.arange(bsz, device=x.device).view(bsz, 1, 1)
        probs = (gate[rows, idx].float() + self.kpool_ape.weight.float()).softmax(dim=2)
        if self.fp32_accumulate:
            return (probs * k[rows, idx].float()).sum(dim=2).to(k.dtype)
        return (probs.to(k.dtype) * k[rows, idx]).sum(dim=2)

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H] FP32 head weights w_h * H^-1/2 (the projection in FP32 with indexer_weights_fp32)."""
        if self.weights_fp32:
            w = F.linear(x.float(), self.weights_proj.weight.float())
        else:
            w = self.weights_proj(x).float()
        return w * self.n_heads**-0.5

    def scores(self, x: torch.Tensor, qr: torch.Tensor, pools: PoolLayout) -> torch.Tensor:
        """Index scores [B, T, P]: sum_h w_h * relu(q_h . pooled_k * d^-1/2), FP32. With indexer_fp8_emulation the
        query and the pooled keys first take serving's FP8 path (rotation after pooling, as serving does)."""
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        pooled = self.pooled_keys(x, pools)
        if self.fp8_emulation:
            q, pooled = fp8_serving_input(q), fp8_serving_input(pooled)
        s = torch.matmul(q.float(), pooled.transpose(-1, -2).float().unsqueeze(1))  # [B, T, H, P]
        s = F.relu(s * self.head_dim**-0.5)
        return torch.matmul(self.head_weights(x).unsqueeze(-2), s).squeeze(-2)

    def visible_pools(self, doc: DocLayout, pools: PoolLayout) -> torch.Tensor:
        """[B, T, P]: pool is complete, in the query's document and its last token is not in the future."""
        t = torch.arange(doc.pos.shape[1], device=doc.pos.device)
        ends = pools.start + self.kpool - 1
        return pools.used[:, None, :] & (ends[:, None, :] <= t[None, :, None]) & (pools.key[:, None, :] == doc.key[:, :, None])

    def select(self, scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """[B, T, P] bool: the top index_topk // kpool visible pools per query."""
        num_slots = scores.shape[-1]
        k = min(self.select_pools, num_slots)
        if k == 0:
            return torch.zeros_like(valid)
        masked = scores.masked_fill(~valid, torch.finfo(scores.dtype).min)
        # Stable descending sort = top-k with ties broken towards the earlier pool. ReLU scoring produces exact
        # ties (all-zero pools); a fixed rule keeps the selection independent of packing and of the kernel.
        top = masked.sort(dim=-1, descending=True, stable=True).indices[..., :k]
        return torch.zeros_like(valid).scatter(-1, top, True) & valid

    def token_mask(self, selected: torch.Tensor, doc: DocLayout, pools: PoolLayout) -> torch.Tensor:
        """Expand selected pools to tokens and add the query's incomplete tail: [B, T, T] bool."""
        bsz, seqlen, _ = selected.shape
        slot = pools.token_slot.clamp(min=0)[:, None, :].expand(bsz, seqlen, seqlen)
        if selected.shape[-1] == 0:
            mask = torch.zeros(bsz, seqlen, seqlen, dtype=torch.bool, device=selected.device)
        else:
            mask = selected.gather(-1, slot) & (pools.token_slot >= 0)[:, None, :]
        if self.always_select_tail:
            t = torch.arange(seqlen, device=selected.device)
            tail = (doc.pos + 1) % self.kpool
            offset = t[None, :, None] - t[None, None, :]  # query - key
            mask = mask | ((offset >= 0) & (offset < tail[:, :, None]))
        return mask

    def init_weights(self) -> None:
        for lin in (self.wq_b, self.wk, self.weights_proj):
            init_linear(lin, std=self.init_std)
        self.k_norm.reset_parameters()
        nn.init.ones_(self.index_kpool_compress_gate)
        self.kpool_ape.init_weights()


class SparseMLA(nn.Module):
    """NoPE MLA (q/kv low-rank with RMSNorm latents, scale qk_head_dim^-1/2) over the indexer's token selection."""

    # Serving runs the MLA attention GEMMs in BF16.
    linear_roles = {name: "mla" for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")}

    def __init__(self, args: Glm5ModelArgs, *, shared_indexer: bool = False) -> None:
        super().__init__()
        d, h = args.hidden_size, args.num_attention_heads
        self.num_heads, self.qk_dim, self.v_dim = h, args.qk_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        self.scale = args.qk_head_dim**-0.5
        self.dense = args.dsa_attention == "dense"
        self.init_std = args.initializer_range
        bias = args.attention_bias
        self.q_a_proj = nn.Linear(d, args.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(args.q_lora_rank, eps=args.rms_norm_eps)
        self.q_b_proj = nn.Linear(args.q_lora_rank, h * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, args.kv_lora_rank + args.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(args.kv_lora_rank, eps=args.rms_norm_eps)
        self.kv_b_proj = nn.Linear(args.kv_lora_rank, h * (args.qk_nope_head_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=bias)
        self.kpool = args.index_kpool
        self.indexer = None if shared_indexer else KPoolIndexer(args)

    def forward(
        self,
        x: torch.Tensor,
        *,
        doc: DocLayout,
        shared_mask: torch.Tensor | None = None,
        collect_stats: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, IndexerStats | None]:
        """Returns (output [B, T, D], token mask [B, T, T] used, indexer stats or None)."""
        bsz, seqlen, _ = x.shape
        qr = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(qr).unflatten(-1, (self.num_heads, self.qk_dim)).transpose(1, 2)
        kv = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x)[..., : self.kv_lora_rank])
        kv = self.kv_b_proj(kv).unflatten(-1, (self.num_heads, -1)).transpose(1, 2)
        k, v = kv.split([self.qk_dim, self.v_dim], dim=-1)

        stats = None
        if self.indexer is None:
            if shared_mask is None:
                raise ValueError("a 'shared' DSA layer needs the previous layer's selection")
            mask = shared_mask
        else:
            pools = pool_layout(doc, self.kpool)
            valid = self.indexer.visible_pools(doc, pools)
            with torch.set_grad_enabled(collect_stats and torch.is_grad_enabled()):
                scores = self.indexer.scores(x.detach(), qr.detach(), pools)
            selected = self.indexer.select(scores.detach(), valid)
            mask = causal_doc_mask(doc) if self.dense else self.indexer.token_mask(selected, doc, pools)
            if collect_stats:
                target = pooled_attention_target(q.detach(), k.detach(), doc, pools, valid, scale=self.scale)
                stats = IndexerStats(scores.clone(), target, valid, selected)  # clone: FSDP2 warns on view outputs
        out = masked_attention(q, k, v, mask, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).flatten(-2)), mask, stats

    def init_weights(self) -> None:
        for name in self.linear_roles:
            init_linear(getattr(self, name), std=self.init_std)
        self.q_a_layernorm.init_weights()
        self.kv_a_layernorm.init_weights()
        if self.indexer is not None:
            self.indexer.init_weights()


@torch.no_grad()
def pooled_attention_target(
    q: torch.Tensor, k: torch.Tensor, doc: DocLayout, pools: PoolLayout, valid: torch.Tensor, *, scale: float,
    query_chunk: int | None = None,
) -> torch.Tensor:
    """KL target: dense causal attention probabilities summed over heads and over each pool's tokens, L1-normalised
    over the visible pools. Computed in FP32 query chunks so [B, H, T, T] never exists at once; by default a chunk
    holds about 2^28 probabilities (1 GiB), e.g. 1024 queries at 64 heads x 4096 keys."""
    bsz, heads, seqlen, _ = q.shape
    if query_chunk is None:
        query_chunk = max(1, 2**28 // (bsz * heads * seqlen))
    num_slots = pools.start.shape[1]
    causal = causal_doc_mask(doc)
    dump = pools.token_slot.masked_fill(pools.token_slot < 0, num_slots)  # tokens outside complete pools
    out = []
    for s in range(0, seqlen, query_chunk):
        e = min(s + query_chunk, seqlen)
        logits = torch.matmul(q[:, :, s:e].float(), k.float().transpose(-1, -2)) * scale
        logits = logits.masked_fill(~causal[:, None, s:e], float("-inf"))
        probs = logits.softmax(dim=-1).sum(dim=1)  # [B, t, T]
        per_pool = torch.zeros(bsz, e - s, num_slots + 1, device=q.device).scatter_add(
            -1, dump[:, None, :].expand(bsz, e - s, seqlen), probs)
        out.append(per_pool[..., :num_slots])
    target = torch.cat(out, dim=1) * valid
    return target / target.sum(-1, keepdim=True).clamp_min(1e-20)
