"""DSA block: NoPE MLA whose attention is restricted to the KPool indexer's selection.

The indexer scores pooled keys (kpool consecutive tokens of one document, softmax-weighted per dimension), keeps
the top index_topk // kpool pools visible to each query, expands them to tokens and always adds the query's
incomplete causal tail: a [B, T, K] index tensor (K = index_topk + kpool - 1, -1 = none) that a following 'shared'
layer reuses. Attention runs in the absorbed MLA form over those indices (ops/sparse_mla.py), the indexer's
selection and KL loss in query tiles (ops/indexer_topk.py, ops/indexer_kl.py): memory is linear in T. The indexer's
inputs are detached: it learns only from its KL loss, computed inside the layer, never from the LM loss.

The dense warm-up (dsa_attention="dense") keeps expanded SDPA under the dense [B, T, T] causal-document mask
(ops/masked_attention.py): quadratic in T, for a short stage; its KL target is computed in query tiles.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_glm.distributed.collectives import all_gather_autograd, sum_grad_over
from torchtitan_glm.ops.indexer_kl import indexer_kl_dense, indexer_kl_sparse
from torchtitan_glm.ops.indexer_topk import kpool_topk, tile_rows
from torchtitan_glm.ops.masked_attention import masked_attention
from torchtitan_glm.ops.sparse_mla import sparse_mla

from .args import Glm5ModelArgs
from .indexer_fp8 import fp8_serving_input
from .layers import RMSNorm, init_linear, local_param


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
    """One DSA layer's indexer KL, computed in the layer; gradient reaches the indexer parameters only."""

    kl_sum: torch.Tensor  # [] FP32: KL(target || softmax(index scores)) summed over the counted queries
    rows: torch.Tensor  # [] FP32: queries with at least one candidate pool (no gradient)


class IndexerInputs(NamedTuple):
    """FP32 operands of the index score sum_h w_h relu(q_h . pk_p * d^-1/2) (ops/indexer_topk.py)."""

    q: torch.Tensor  # [B, T, H, D]
    w: torch.Tensor  # [B, T, H], H^-1/2 included
    pk: torch.Tensor  # [B, P, D] pooled keys


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
    """Lightning indexer over kpool-pooled keys; selects the sparse attention's [B, T, K] token indices."""

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

    def inputs(self, x: torch.Tensor, qr: torch.Tensor, pools: PoolLayout) -> IndexerInputs:
        """The score's FP32 operands. With indexer_fp8_emulation the query and the pooled keys first take serving's
        FP8 path (rotation after pooling, as serving does): elementwise per row, so the tiled ops see the result."""
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        pooled = self.pooled_keys(x, pools)
        if self.fp8_emulation:
            q, pooled = fp8_serving_input(q), fp8_serving_input(pooled)
        return IndexerInputs(q.float(), self.head_weights(x), pooled.float())

    def select(self, inp: IndexerInputs, doc: DocLayout, pools: PoolLayout, *, budget: int) -> torch.Tensor:
        """[B, T, min(index_topk // kpool, P)] int64: the selected pool slots, best first, -1 padding. Ties go to the
        earlier pool: ReLU scoring produces exact ties (all-zero pools), and a fixed rule keeps the selection
        independent of packing, tiling and kernel."""
        num_slots = inp.pk.shape[1]
        k = min(self.select_pools, num_slots)
        tile = tile_rows(self.n_heads * num_slots, budget)
        return kpool_topk(inp.q.detach(), inp.w.detach(), inp.pk.detach(), pool_last(pools, self.kpool, doc),
                          pools.key, doc.key, k, self.kpool, tile)

    def token_indices(self, pool_ids: torch.Tensor, doc: DocLayout, pools: PoolLayout) -> torch.Tensor:
        """[B, T, K] int32 tokens: the selected pools' kpool tokens in pool_ids order, then the query's incomplete
        tail (its last (pos + 1) % kpool tokens, the query included) when always_select_tail; -1 = none."""
        bsz, seqlen, k = pool_ids.shape
        device = pool_ids.device
        start = pools.start.gather(1, pool_ids.clamp(min=0).flatten(1)).view(bsz, seqlen, k, 1)
        tokens = torch.where(pool_ids.unsqueeze(-1) >= 0, start + torch.arange(self.kpool, device=device), -1)
        parts = [tokens.flatten(2)]
        if self.always_select_tail:
            back = torch.arange(self.kpool - 1, device=device)
            t = torch.arange(seqlen, device=device).view(1, seqlen, 1)
            tail_len = ((doc.pos + 1) % self.kpool).unsqueeze(-1)
            parts.append(torch.where(back < tail_len, t - back, -1).expand(bsz, seqlen, -1))
        return torch.cat(parts, dim=-1).to(torch.int32)

    def init_weights(self) -> None:
        for lin in (self.wq_b, self.wk, self.weights_proj):
            init_linear(lin, std=self.init_std)
        self.k_norm.reset_parameters()
        nn.init.ones_(self.index_kpool_compress_gate)
        self.kpool_ape.init_weights()


def pool_last(pools: PoolLayout, kpool: int, doc: DocLayout) -> torch.Tensor:
    """[B, P] last token of each pool slot; T (never visible) for unused slots."""
    return torch.where(pools.used, pools.start + kpool - 1, doc.pos.shape[1])


class SparseMLA(nn.Module):
    """NoPE MLA (q/kv low-rank with RMSNorm latents, scale qk_head_dim^-1/2) over the indexer's token selection."""

    # Serving runs the MLA attention GEMMs in BF16.
    linear_roles = {name: "mla" for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")}
    # The absorbed form reads kv_b_proj through its weight (W_UK, W_UV), never calls it on the sparse path: a
    # float8 conversion would not reach it.
    weight_only_linears = {"kv_b_proj"}

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
        self.tile_elements = args.indexer_tile_elements  # working-set bound of the tiled indexer ops
        self.indexer = None if shared_indexer else KPoolIndexer(args)
        # The tensor-parallel group this block's heads are split over (set by parallelize.py, None otherwise).
        self.heads_group = None

    def forward(
        self,
        x: torch.Tensor,
        *,
        doc: DocLayout,
        shared_indices: torch.Tensor | None = None,
        indexer_kl: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, IndexerStats | None]:
        """Returns (output [B, T, D], token indices [B, T, K] used (None in the dense stage), indexer KL or None).

        indexer_kl: None, "sparse" (over the selected pools, target = this sparse attention) or "dense" (over every
        candidate pool, target = dense causal attention)."""
        if indexer_kl not in (None, "sparse", "dense"):
            raise ValueError(f"indexer_kl must be None, 'sparse' or 'dense', got {indexer_kl!r}")
        if indexer_kl == "sparse" and self.dense:
            raise ValueError("the sparse indexer KL needs sparse attention (dsa_attention='sparse')")
        qr = self.q_a_layernorm(self.q_a_proj(x))
        # heads: all of them, or this rank's under tensor parallelism (q_b / kv_b column-parallel)
        q = self.q_b_proj(qr).unflatten(-1, (-1, self.qk_dim))  # [B, T, H, qk]
        latent = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x)[..., : self.kv_lora_rank])  # [B, T, R]
        w_kv = local_param(self.kv_b_proj.weight).unflatten(0, (-1, self.qk_dim + self.v_dim))
        w_uk, w_uv = w_kv.split([self.qk_dim, self.v_dim], 1)
        q_lat = torch.einsum("bthd,hdr->bthr", q, w_uk) if not self.dense or indexer_kl else None  # absorbed query

        indices, stats = shared_indices, None
        if self.indexer is None:
            if shared_indices is None and not self.dense:
                raise ValueError("a 'shared' DSA layer needs the previous layer's selection")
        elif not self.dense or indexer_kl is not None:
            pools = pool_layout(doc, self.kpool)
            with torch.set_grad_enabled(indexer_kl is not None and torch.is_grad_enabled()):
                inp = self.indexer.inputs(x.detach(), qr.detach(), pools)
            if not self.dense:
                pool_ids = self.indexer.select(inp, doc, pools, budget=self.tile_elements)
                indices = self.indexer.token_indices(pool_ids, doc, pools)
            if indexer_kl is not None:
                attn_q = q_lat.detach()
                if self.heads_group is not None:  # the target sums over all heads: gather the other TP ranks'
                    attn_q = all_gather_autograd(attn_q, dim=2, group=self.heads_group)
                stats = self._indexer_kl(indexer_kl, inp, doc, pools, attn_q, latent.detach(),
                                         pool_ids if indexer_kl == "sparse" else None, indices)

        if self.dense:
            kv = self.kv_b_proj(latent).unflatten(-1, (-1, self.qk_dim + self.v_dim)).transpose(1, 2)
            k, v = kv.split([self.qk_dim, self.v_dim], dim=-1)
            out = masked_attention(q.transpose(1, 2), k, v, causal_doc_mask(doc), scale=self.scale).transpose(1, 2)
            indices = None
        else:
            if self.heads_group is not None:  # the latent is replicated; each TP rank's heads add to its gradient
                latent = sum_grad_over(latent, group=self.heads_group)
            out = torch.einsum("bthr,hvr->bthv", sparse_mla(q_lat, latent, indices, scale=self.scale), w_uv)
        return self.o_proj(out.flatten(-2)), indices, stats

    def _indexer_kl(
        self, mode: str, inp: IndexerInputs, doc: DocLayout, pools: PoolLayout, attn_q: torch.Tensor,
        attn_kv: torch.Tensor, pool_ids: torch.Tensor | None, indices: torch.Tensor | None,
    ) -> IndexerStats:
        need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in inp)
        heads_i, num_slots = inp.q.shape[2], inp.pk.shape[1]
        if mode == "sparse":
            width = indices.shape[-1] * (attn_kv.shape[-1] + attn_q.shape[2]) + pool_ids.shape[-1] * heads_i
            kl, rows, *_ = indexer_kl_sparse(*inp, pool_ids, attn_q, attn_kv, indices, self.scale, self.kpool,
                                             tile_rows(width, self.tile_elements), need_grad)
        else:
            width = max(heads_i * num_slots, attn_q.shape[2] * doc.pos.shape[1])
            kl, rows, *_ = indexer_kl_dense(*inp, pools.start, pool_last(pools, self.kpool, doc), pools.key, doc.key,
                                            attn_q, attn_kv, self.scale, self.kpool,
                                            tile_rows(width, self.tile_elements), need_grad)
        return IndexerStats(kl, rows)

    def init_weights(self) -> None:
        for name in self.linear_roles:
            init_linear(getattr(self, name), std=self.init_std)
        self.q_a_layernorm.init_weights()
        self.kv_a_layernorm.init_weights()
        if self.indexer is not None:
            self.indexer.init_weights()
