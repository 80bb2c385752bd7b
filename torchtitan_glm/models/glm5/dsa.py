"""DSA block: NoPE MLA whose attention is restricted to the KPool indexer's selection.

The indexer scores pooled keys (kpool consecutive tokens of one document, softmax-weighted per dimension), keeps
the top index_topk // kpool pools visible to each query, expands them to tokens and always adds the query's
incomplete causal tail: a [B, T, K] index tensor (K = index_topk + kpool - 1, -1 = none) that a following 'shared'
layer reuses. Attention runs in the absorbed MLA form over those indices (ops/sparse_mla.py), the indexer's
selection and KL loss in query tiles (ops/indexer_topk.py, ops/indexer_kl.py): memory is linear in T. The indexer's
inputs are detached: it learns only from its KL loss, computed inside the layer, never from the LM loss.

The dense warm-up (dsa_attention="dense") keeps expanded SDPA under the dense [B, T, T] causal-document mask
(ops/masked_attention.py): quadratic in T, for a short stage; its KL target is computed in query tiles. Sparse-stage
rows of at most dsa_dense_max_len tokens run that dense kernel under the selection's own mask (faster at short T).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_glm.distributed.collectives import all_gather_autograd, sum_grad_over
from torchtitan_glm.ops.indexer_kl import indexer_kl_dense, indexer_kl_sparse
from torchtitan_glm.ops.indexer_topk import kpool_topk, tile_rows
from torchtitan_glm.ops.indexer_topk import _stable_topk as stable_topk  # the selection's tie rule, for decode
from torchtitan_glm.ops.masked_attention import masked_attention
from torchtitan_glm.ops.sparse_mla import sparse_mla

from .args import Glm5ModelArgs
from .batch import BatchLayout, DocLayout
from .cache import IndexerCache, MLACache
from .indexer_fp8 import fp8_serving_input
from .layers import RMSNorm, init_linear, local_param


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


def _query_chunks(cp, local_len: int) -> list[tuple[int, int, int]]:
    """(local start, local end, row position of its first query) of each run of consecutive row positions among
    this rank's queries: the whole row without context parallelism, the zigzag's two chunks with it."""
    if cp is None:
        return [(0, local_len, 0)]
    if cp.layout.per_document:
        raise ValueError("DSA under context parallelism needs the row zigzag (context-parallel layout 'zigzag')")
    chunk, size, rank = local_len // 2, cp.layout.size, cp.layout.rank  # rank r holds chunks r and 2 cp - 1 - r
    return [(0, chunk, rank * chunk), (chunk, local_len, (2 * size - 1 - rank) * chunk)]


def _cp_causal_doc_mask(doc: DocLayout, full_doc: DocLayout, positions: torch.Tensor) -> torch.Tensor:
    """[B, T_local, T] causal mask within documents of this rank's queries against the whole rows' keys."""
    keys = torch.arange(full_doc.pos.shape[1], device=positions.device)
    causal = keys[None, None, :] <= positions.to(keys.device)[:, :, None]
    return causal & (doc.key[:, :, None] == full_doc.key[:, None, :])


def selection_mask(indices: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[B, T, num_keys] boolean mask of a [B, T, K] token selection (-1 = none)."""
    slots = indices.masked_fill(indices < 0, num_keys).long()
    hit = torch.zeros(*indices.shape[:2], num_keys + 1, dtype=torch.bool, device=indices.device)
    return hit.scatter_(2, slots, True)[..., :num_keys]


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

    def pooled_keys(self, x: torch.Tensor, pools: PoolLayout, gather=None) -> torch.Tensor:
        """[B, P, D] pooled keys: per-dimension softmax over each pool's kpool slots (gate + APE, FP32) weighting the
        normalised keys; summed in the keys' dtype (the reference) or in FP32 with one rounding (kpool_fp32_accumulate).
        gather: the whole rows' per-token keys and gates from this rank's (context parallelism)."""
        bsz = x.shape[0]
        k, gate = self.token_keys(x)
        if gather is not None:
            k, gate = gather(k), gather(gate)
        idx = (pools.start.unsqueeze(-1) + torch.arange(self.kpool, device=x.device)).clamp(max=k.shape[1] - 1)
        rows = torch.arange(bsz, device=x.device).view(bsz, 1, 1)
        return self.pool(k[rows, idx], gate[rows, idx])

    def token_keys(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token: the normalised key and the compression-gate logits, [..., D] each (what a pool combines)."""
        return self.k_norm(self.wk(x)), F.linear(x, self.index_kpool_compress_gate)

    def pool(self, k: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """[..., kpool, D] keys and gate logits of complete pools -> [..., D] pooled keys (see pooled_keys)."""
        probs = (gate.float() + self.kpool_ape.weight.float()).softmax(dim=-2)
        if self.fp32_accumulate:
            return (probs * k.float()).sum(dim=-2).to(k.dtype)
        return (probs.to(k.dtype) * k).sum(dim=-2)

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H] FP32 head weights w_h * H^-1/2 (the projection in FP32 with indexer_weights_fp32)."""
        if self.weights_fp32:
            w = F.linear(x.float(), self.weights_proj.weight.float())
        else:
            w = self.weights_proj(x).float()
        return w * self.n_heads**-0.5

    def inputs(self, x: torch.Tensor, qr: torch.Tensor, pools: PoolLayout, gather=None) -> IndexerInputs:
        """The score's FP32 operands. With indexer_fp8_emulation the query and the pooled keys first take serving's
        FP8 path (rotation after pooling, as serving does): elementwise per row, so the tiled ops see the result."""
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        pooled = self.pooled_keys(x, pools, gather)
        if self.fp8_emulation:
            q, pooled = fp8_serving_input(q), fp8_serving_input(pooled)
        return IndexerInputs(q.float(), self.head_weights(x), pooled.float())

    def select(self, inp: IndexerInputs, doc: DocLayout, pools: PoolLayout, *, budget: int,
               q_start: int = 0) -> torch.Tensor:
        """[B, T, min(index_topk // kpool, P)] int64: the selected pool slots, best first, -1 padding. Ties go to the
        earlier pool: ReLU scoring produces exact ties (all-zero pools), and a fixed rule keeps the selection
        independent of packing, tiling and kernel."""
        num_slots = inp.pk.shape[1]
        k = min(self.select_pools, num_slots)
        tile = tile_rows(self.n_heads * num_slots, budget)
        return kpool_topk(inp.q.detach(), inp.w.detach(), inp.pk.detach(), pool_last(pools, self.kpool, doc),
                          pools.key, doc.key, k, self.kpool, tile, q_start)

    def token_indices(self, pool_ids: torch.Tensor, doc: DocLayout, pools: PoolLayout, *,
                      q_start: int = 0) -> torch.Tensor:
        """[B, T, K] int32 tokens: the selected pools' kpool tokens in pool_ids order, then the query's incomplete
        tail (its last (pos + 1) % kpool tokens, the query included) when always_select_tail; -1 = none."""
        bsz, seqlen, k = pool_ids.shape
        device = pool_ids.device
        start = pools.start.gather(1, pool_ids.clamp(min=0).flatten(1)).view(bsz, seqlen, k, 1)
        tokens = torch.where(pool_ids.unsqueeze(-1) >= 0, start + torch.arange(self.kpool, device=device), -1)
        parts = [tokens.flatten(2)]
        if self.always_select_tail:
            back = torch.arange(self.kpool - 1, device=device)
            t = torch.arange(q_start, q_start + seqlen, device=device).view(1, seqlen, 1)
            tail_len = ((doc.pos + 1) % self.kpool).unsqueeze(-1)
            parts.append(torch.where(back < tail_len, t - back, -1).expand(bsz, seqlen, -1))
        return torch.cat(parts, dim=-1).to(torch.int32)

    def init_weights(self) -> None:
        for lin in (self.wq_b, self.wk, self.weights_proj):
            init_linear(lin, std=self.init_std)
        self.k_norm.reset_parameters()
        nn.init.ones_(self.index_kpool_compress_gate)
        self.kpool_ape.init_weights()

    # ------------------------------------------------------------------ decode (models/glm5/decode.py)
    def prefill_cache(self, x: torch.Tensor, first: torch.Tensor, capacity: int) -> IndexerCache:
        """The cache after the prompts x[b, first[b]:] (the rows' ends): the pooled keys of their complete pools,
        computed as training computes them, and the open pool's per-token keys and gate logits."""
        bsz, seqlen = x.shape[:2]
        kp, device = self.kpool, x.device
        k, gate = self.token_keys(x)
        rows = torch.arange(bsz, device=device).view(bsz, 1, 1)
        closed = (seqlen - first) // kp  # [B] complete pools of each prompt
        slots = torch.arange(seqlen // kp, device=device)
        tokens = (first.view(bsz, 1, 1) + slots.view(1, -1, 1) * kp + torch.arange(kp, device=device)).clamp(
            max=seqlen - 1)
        pooled = self.pool(k[rows, tokens], gate[rows, tokens])
        if self.fp8_emulation:
            pooled = fp8_serving_input(pooled)
        pooled = torch.where((slots < closed.unsqueeze(1)).unsqueeze(-1), pooled, 0)
        pooled = F.pad(pooled, (0, 0, 0, -(-capacity // kp) - pooled.shape[1]))
        open_tokens = (first + closed * kp).unsqueeze(1) + torch.arange(kp, device=device)  # [B, kpool]
        in_prompt = (open_tokens < seqlen).unsqueeze(-1)
        rows = rows.view(bsz, 1)
        open_tokens = open_tokens.clamp(max=seqlen - 1)
        return IndexerCache(pooled, torch.where(in_prompt, k[rows, open_tokens], 0),
                            torch.where(in_prompt, gate[rows, open_tokens], 0))

    def decode(self, x: torch.Tensor, qr: torch.Tensor, cache: IndexerCache, pos: torch.Tensor) -> torch.Tensor:
        """Token indices [B, 1, K] int32 (prompt positions, -1 = none) for one query per row at positions pos [B]:
        the token joins the open pool, which is pooled into the cache when this token closes it; then the query
        scores the closed pools (training's score, selection rule and tail), as training selects for it."""
        kp = self.kpool
        rows = torch.arange(x.shape[0], device=x.device)
        k, gate = self.token_keys(x)
        slot = pos % kp
        cache.keys[rows, slot] = k[:, 0].to(cache.keys.dtype)
        cache.gates[rows, slot] = gate[:, 0].to(cache.gates.dtype)
        pooled = self.pool(cache.keys, cache.gates)  # [B, D]: the open pool, stored only if this token closes it
        if self.fp8_emulation:
            pooled = fp8_serving_input(pooled)
        num_slots = cache.pooled.shape[1]
        j = (pos // kp).clamp(max=num_slots - 1)
        cache.pooled[rows, j] = torch.where((slot == kp - 1).unsqueeze(-1), pooled.to(cache.pooled.dtype),
                                            cache.pooled[rows, j])
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        if self.fp8_emulation:
            q = fp8_serving_input(q)
        per_head = torch.matmul(q[:, 0].float(), cache.pooled.float().transpose(1, 2)).mul_(self.head_dim**-0.5)
        scores = torch.matmul(self.head_weights(x), per_head.relu_()).squeeze(1)  # [B, P]
        visible = torch.arange(num_slots, device=x.device) < ((pos + 1) // kp).unsqueeze(1)
        pool_ids = stable_topk(scores, visible, min(self.select_pools, num_slots))
        first = pool_ids.unsqueeze(-1) * kp
        tokens = torch.where(first >= 0, first + torch.arange(kp, device=x.device), -1)
        parts = [tokens.flatten(1)]
        if self.always_select_tail:
            back = torch.arange(kp - 1, device=x.device)
            parts.append(torch.where(back < ((pos + 1) % kp).unsqueeze(1), pos.unsqueeze(1) - back, -1))
        return torch.cat(parts, dim=-1).unsqueeze(1).to(torch.int32)


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
        self.dense_dsa_kernel = args.dense_dsa_kernel
        self.mask_query_chunk = args.dsa_mask_query_chunk
        self.causal_rows = args.causal_dsa_rows  # the leading rows of a one-document row that need no mask
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
        self, x: torch.Tensor, batch: BatchLayout, shared_indices: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, IndexerStats | None]:
        """Returns (output [B, T, D], token indices [B, T, K] used (None in the dense stage), indexer KL or None).

        batch.indexer_kl: None, "sparse" (over the selected pools, target = this sparse attention) or "dense" (over
        every candidate pool, target = dense causal attention)."""
        doc, indexer_kl, cp = batch.doc, batch.indexer_kl, batch.cp
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
        # Context parallelism: this rank's queries attend the whole rows, so the latent (and, in the indexer, the
        # keys and their pooling gates) are all-gathered; pools and documents are those of the whole rows.
        gather = None if cp is None else (lambda t: cp.layout.unshard(t, group=cp.group))
        full_doc = doc if cp is None else cp.full_doc
        dense_kernel = self.dense_dsa_kernel(full_doc.pos.shape[1])  # static: the row length
        # the absorbed query: the sparse kernel's, and the indexer KL's target
        q_lat = torch.einsum("bthd,hdr->bthr", q, w_uk) if not dense_kernel or indexer_kl else None
        latent_all = latent if gather is None else gather(latent)

        indices, stats = shared_indices, None
        if self.indexer is None:
            if shared_indices is None and not self.dense:
                raise ValueError("a 'shared' DSA layer needs the previous layer's selection")
        elif not self.dense or indexer_kl is not None:
            pools = pool_layout(full_doc, self.kpool)
            with torch.set_grad_enabled(indexer_kl is not None and torch.is_grad_enabled()):
                inp = self.indexer.inputs(x.detach(), qr.detach(), pools, gather=gather)
            attn_q = None
            if indexer_kl is not None:
                attn_q = q_lat.detach()
                if self.heads_group is not None:  # the target sums over all heads: gather the other TP ranks'
                    attn_q = all_gather_autograd(attn_q, dim=2, group=self.heads_group)
            pieces, kl_parts = [], []
            for s0, s1, row_pos in _query_chunks(cp, x.shape[1]):
                part, chunk_doc, chunk_q = inp, doc, attn_q
                if cp is not None:  # this chunk's queries
                    part = IndexerInputs(inp.q[:, s0:s1], inp.w[:, s0:s1], inp.pk)
                    chunk_doc = DocLayout(*(t[:, s0:s1] for t in doc))
                    chunk_q = None if attn_q is None else attn_q[:, s0:s1]
                pool_ids = None
                if not self.dense:
                    pool_ids = self.indexer.select(part, full_doc, pools, budget=self.tile_elements, q_start=row_pos)
                    pieces.append(self.indexer.token_indices(pool_ids, chunk_doc, pools, q_start=row_pos))
                if indexer_kl is not None:
                    kl_parts.append(self._indexer_kl(indexer_kl, part, full_doc, pools, chunk_q,
                                                     latent_all.detach(), pool_ids,
                                                     pieces[-1] if pieces else None, row_pos))
            if not self.dense:
                indices = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
            if len(kl_parts) == 1:
                stats = kl_parts[0]
            elif kl_parts:
                stats = IndexerStats(sum(k.kl_sum for k in kl_parts), sum(k.rows for k in kl_parts))

        if dense_kernel:
            kv = self.kv_b_proj(latent_all).unflatten(-1, (-1, self.qk_dim + self.v_dim)).transpose(1, 2)
            k, v = kv.split([self.qk_dim, self.v_dim], dim=-1)
            # one document per row and no context parallelism: the leading rows whose mask is plain causal run
            # without it (every row in the dense stage, which then forms no mask)
            causal_rows = self.causal_rows(x.shape[1]) if batch.doc_ids is None and cp is None else 0
            if self.dense and causal_rows == x.shape[1]:
                mask = None
            elif self.dense:
                mask = causal_doc_mask(doc) if cp is None else _cp_causal_doc_mask(doc, full_doc, cp.positions)
            else:  # the selected set as a mask: the same function as the sparse kernel, at dense cost
                mask = selection_mask(indices, full_doc.pos.shape[1])
            # a context-parallel rank's queries are not the row's first ones: one call
            chunk = self.mask_query_chunk if cp is None else 0
            out = masked_attention(q.transpose(1, 2), k, v, mask, scale=self.scale, causal_chunk=chunk,
                                   causal_rows=causal_rows).transpose(1, 2)
        else:
            if self.heads_group is not None:  # the latent is replicated; each TP rank's heads add to its gradient
                latent_all = sum_grad_over(latent_all, group=self.heads_group)
            out = torch.einsum("bthr,hvr->bthv", sparse_mla(q_lat, latent_all, indices, scale=self.scale), w_uv)
        return self.o_proj(out.flatten(-2)), indices, stats

    def _indexer_kl(
        self, mode: str, inp: IndexerInputs, doc: DocLayout, pools: PoolLayout, attn_q: torch.Tensor,
        attn_kv: torch.Tensor, pool_ids: torch.Tensor | None, indices: torch.Tensor | None, q_start: int = 0,
    ) -> IndexerStats:
        """The KL of queries q_start .. of the rows (doc, pools, attn_kv: the whole rows)."""
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
                                            tile_rows(width, self.tile_elements), need_grad, q_start)
        return IndexerStats(kl, rows)

    def init_weights(self) -> None:
        for name in self.linear_roles:
            init_linear(getattr(self, name), std=self.init_std)
        self.q_a_layernorm.init_weights()
        self.kv_a_layernorm.init_weights()
        if self.indexer is not None:
            self.indexer.init_weights()

    # ------------------------------------------------------------------ decode (models/glm5/decode.py)
    def prefill(self, x: torch.Tensor, batch: BatchLayout, shared_indices: torch.Tensor | None = None, *,
                capacity: int) -> tuple[torch.Tensor, torch.Tensor | None, MLACache]:
        """forward()'s (output, indices) for rows that each end with a prompt (left padding as a document before
        it), and the cache of each prompt: its latents and the indexer's pools, in prompt positions."""
        out, indices, _ = self.forward(x, batch, shared_indices)
        bsz, seqlen = x.shape[:2]
        first = batch.doc.key[:, -1]  # where each row's last document, its prompt, starts
        latent = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x)[..., : self.kv_lora_rank])
        t = first.unsqueeze(1) + torch.arange(capacity, device=x.device)
        kept = latent.gather(1, t.clamp(max=seqlen - 1).unsqueeze(-1).expand(-1, -1, latent.shape[-1]))
        cache = torch.where((t < seqlen).unsqueeze(-1), kept, 0)
        indexer = None if self.indexer is None or self.dense else self.indexer.prefill_cache(x, first, capacity)
        return out, indices, MLACache(cache, indexer)

    def decode(self, x: torch.Tensor, cache: MLACache, pos: torch.Tensor,
               shared_indices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row: x [B, 1, D] at prompt positions pos [B] -> (output, the token indices [B, 1, K] it
        attended); appends its latent to `cache`. Absorbed MLA over the cached latents, as the sparse forward."""
        rows = torch.arange(x.shape[0], device=x.device)
        qr = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(qr).unflatten(-1, (-1, self.qk_dim))
        latent = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x)[..., : self.kv_lora_rank])
        cache.latent[rows, pos] = latent[:, 0].to(cache.latent.dtype)
        w_kv = local_param(self.kv_b_proj.weight).unflatten(0, (-1, self.qk_dim + self.v_dim))
        w_uk, w_uv = w_kv.split([self.qk_dim, self.v_dim], 1)
        q_lat = torch.einsum("bthd,hdr->bthr", q, w_uk)
        if self.dense:  # the dense warm-up: every earlier token of the prompt
            t = torch.arange(cache.latent.shape[1], device=x.device)
            indices = torch.where(t <= pos.unsqueeze(1), t, -1).unsqueeze(1).to(torch.int32)
        elif self.indexer is None:
            if shared_indices is None:
                raise ValueError("a 'shared' DSA layer needs the previous layer's selection")
            indices = shared_indices
        else:
            indices = self.indexer.decode(x, qr, cache.indexer, pos)
        out = torch.einsum("bthr,hvr->bthv", sparse_mla(q_lat, cache.latent, indices, scale=self.scale), w_uv)
        return self.o_proj(out.flatten(-2)), indices
