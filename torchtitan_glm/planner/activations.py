"""Activation memory of one block, by layer type and regime: what autograd keeps for the backward, and the working
set that exists only while the block runs.

Regimes: `eager` (no AC, eager autograd), `compiled` (no AC, inductor's min-cut partition of each compiled block),
`selective` (activation_checkpoint.py's policy: outputs of matmuls, attention and the KDA kernel are saved, the rest is
recomputed; the same eager or compiled; `ActContext.recompute`, activation_checkpoint.recompute_modules, drops the
listed parts' saved outputs too) and `full` (only the block's inputs are saved).

The inventories below were read off the blocks' code and checked against the tensors autograd really saves, block by
block, on CPU (tests/unit/test_planner_activations.py measures them with saved-tensor hooks, eager and inductor-
compiled, on a small model with distinct widths). Two things differ on CUDA and are modelled for `device="cuda"`:
FLA's KDA forward also saves its intra-chunk matrices Aqk and Akk ([N, H, 64] each), and masked attention runs
cuDNN's kernel (saving q, k, v, the output, the log-sum-exp and the boolean mask) where the CPU takes the math path
(FP32 probabilities; the dense warm-up's path only: the sparse path's kernels are custom ops that keep the same
tensors on every device). Per-token sizes scale with the rank's tokens; attention and indexer terms also with the keys
a query spans. Tensor parallelism (parallelize.py: heads and MLP columns split, no sequence parallelism) divides
the terms of the split heads and columns by tp; the streams, norms, mHC, router, routed experts, the MLA latents and
the indexer are whole on every tensor-parallel rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torchtitan_glm.models.glm5.args import Glm5ModelArgs
from torchtitan_glm.models.glm5.layers import BWD_CHUNK_ELEMENTS

REGIMES = ("eager", "compiled", "selective", "full")
FLA_CHUNK = 64  # FLA's KDA chunk: its saved Aqk/Akk have this many columns


@dataclass(frozen=True)
class ActContext:
    """The shapes one rank's blocks see and what the step computes."""

    args: Glm5ModelArgs
    batch: int  # rows per rank
    seq: int  # tokens per row on this rank (seq_len / cp)
    keys: int  # tokens a row spans (seq_len): attention keys and indexer pools
    act: int = 2  # bytes per activation element (2: BF16 compute, 4: FP32)
    tp: int = 1
    device: str = "cuda"
    fp32_params: bool = True  # FP32-kept parameters are FP32 (trainer); False: cast to BF16 (benchmark)
    collect_stats: bool = True  # the indexer runs with gradients and returns KL statistics (training)
    sparse_kl: bool = False  # the KL over the selected pools only (loss.indexer_sparse_loss)
    cp: int = 1  # context-parallel degree: seq = keys / cp, and DSA all-gathers the whole rows (see _dsa)
    moe_chunk: int = 0  # activation_checkpoint.moe_chunk_tokens (0 = off)
    offload_inputs: bool = False  # activation_checkpoint.offload_inputs: full AC's saved inputs in host memory
    compiled: bool = True  # the blocks are compiled: under AC what a block holds while it runs is its compiled
    # inventory, in eager its eager one
    recompute: tuple[str, ...] = ()  # activation_checkpoint.recompute_modules (selective): labels not kept
    # the rows carry document ids (data.document_masking; the caller sets it under CP, where the trainer always
    # passes ids): false, each row is one causal sequence, so no block keeps ids and the dense DSA kernel runs causal
    # rows without a mask (dsa.py, masked_attention.py)
    document_masking: bool = True
    # activation_checkpoint.kda_disable_recompute: the KDA op's residuals include FLA's forward intermediates
    kda_saved_states: bool = False

    def recomputes(self, label: str) -> bool:
        return label in self.recompute

    @property
    def causal_dsa_rows(self) -> int:
        """Leading rows the dense DSA kernel runs causal with no mask: one-document rows only."""
        return 0 if self.document_masking else self.args.causal_dsa_rows(self.keys)

    @property
    def dsa_mask(self) -> bool:
        """Whether the dense DSA kernel forms a [T, T] mask (all but a one-document dense stage)."""
        return self.causal_dsa_rows < self.keys

    @property
    def running(self) -> str:
        """The regime whose inventory a checkpointed block holds while its forward or recompute runs."""
        return "compiled" if self.compiled else "eager"

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def expert_share(self) -> float:
        """The share of the tokens whose routed-expert rows are alive at once: one checkpointed chunk of
        moe_chunk_tokens (recomputed in backward), or all of them."""
        return self.moe_chunk / self.tokens if 0 < self.moe_chunk < self.tokens else 1.0

    @property
    def pools(self) -> int:
        return self.keys // self.args.index_kpool


class _Terms:
    """Named byte counts: per-token terms (x this rank's tokens; / tp where the tensor-parallel plan splits the heads
    or columns the term belongs to) and fixed ones (per block, independent of tokens)."""

    def __init__(self, ctx: ActContext) -> None:
        self.ctx = ctx
        self.out: dict[str, float] = {}

    def tok(self, name: str, per_token: float, *, heads: bool = False) -> None:
        self.out[name] = self.out.get(name, 0.0) + per_token * self.ctx.tokens / (self.ctx.tp if heads else 1)

    def key(self, name: str, per_key: float) -> None:
        """A term over the whole rows (x rows x keys): under context parallelism what DSA all-gathers and pools."""
        self.out[name] = self.out.get(name, 0.0) + per_key * self.ctx.batch * self.ctx.keys

    def fixed(self, name: str, nbytes: float) -> None:
        self.out[name] = self.out.get(name, 0.0) + nbytes


# ------------------------------------------------------------------------------------------ sub-blocks
def _mhc_site(t: _Terms, regime: str, *, first: bool) -> None:
    """One HyperConnection site (two per decoder layer): its input streams, the FP32 mapping, Sinkhorn, the merge.
    Compiled, the second site's input streams are not kept: the first site's merge is pointwise there (mhc.py
    mix_streams), so backward recomputes them from the block's input, the mixer's output and the small maps."""
    c, a = t.ctx, t.ctx.act
    d, n, it = c.args.hidden_size, c.args.hc_mult, c.args.hc_sinkhorn_iters
    width = (2 + n) * n
    cast = a != 4  # post/comb cast to the streams' dtype (a no-op for FP32 streams)
    if regime == "full":
        return
    if regime == "selective":
        if not c.recomputes("mhc"):
            t.tok("mhc", 4 * width)  # the fn matmul's FP32 output
        return
    if first or regime != "compiled":
        t.tok("streams", n * d * a)  # the site's input streams
    if not c.fp32_params:
        t.fixed("mhc", width * n * d * 4)  # fn.float(): an FP32 copy of the BF16-cast weight
    if regime == "compiled":
        t.tok("mhc", 4 * n * n + 8 * n + 4 + (2 * n * n + 2 * n if cast else 0))
        return
    fp32_mix = c.args.mhc_fp32_mixing
    per_site = 4  # the per-row rsqrt (mhc.rms_linear keeps the BF16 streams, not FP32 copies)
    per_site += 4 * width + 3 * 4 * n  # the mapping output, sigmoid outputs, pre (+eps)
    per_site += 4 * n * n * 2 * it + 4 * n * (2 * it - 1)  # Sinkhorn: every division keeps both operands
    if fp32_mix:  # merge in FP32: post, block output and residual cast to FP32
        per_site += 4 * n + 4 * d + 4 * n * d + 4 * n * n
    else:
        per_site += (a * n + a * n * n if cast else 4 * n + 4 * n * n) + d * a  # post, comb (casts), block output
    t.tok("mhc", per_site)


def _norm(t: _Terms, regime: str, width: int, name: str = "norms") -> None:
    """RMSNorm over `width`: eager keeps x.float(), rsqrt and the cast; compiled keeps the output (a GEMM's input)."""
    a = t.ctx.act
    if regime == "eager":
        t.tok(name, 4 * width + 4 + width * a)
    elif regime == "compiled":
        t.tok(name, width * a + 4)


def _kda_states_per_token(c: ActContext) -> float:
    """Bytes per token of FLA's KDA forward intermediates (w, u, gated q / k, new values, chunk states), all heads:
    what the KDA op also keeps under activation_checkpoint.kda_disable_recompute (ops/kda.py)."""
    h, k = c.args.linear_num_heads, c.args.linear_head_dim
    return (5 * h * k + h * k * k / FLA_CHUNK) * c.act


def _kda(t: _Terms, regime: str) -> None:
    c, a = t.ctx, t.ctx.act
    d, h, k, w = c.args.hidden_size, c.args.linear_num_heads, c.args.linear_head_dim, c.args.linear_conv_kernel_dim
    hk = h * k
    residuals = 2 * h * FLA_CHUNK * a if c.device == "cuda" else 0
    if residuals and c.kda_saved_states:  # w, qg, kg [H, K]; u, v_new [H, V]; the chunk states [H, K, V] / 64 tokens
        residuals += _kda_states_per_token(c)
    if regime == "full" or (regime == "selective" and c.recomputes("kda")):  # recompute "kda": only its input
        return
    if residuals:  # selective AC saves the KDA op's outputs (kda_fwd, and kda_cp_fwd under CP)
        t.tok("kda_fla_residuals", residuals, heads=True)
    if regime == "selective":  # q, k, v, f_b, b, g_b projections and the KDA output (heads); f_a, g_a; o_proj
        t.tok("kda", (3 * hk + hk + h + hk + hk) * a, heads=True)
        t.tok("kda", 2 * k * a + d * a)
        return
    if c.cp > 1 and regime in ("compiled", "eager"):
        # each conv's halo [B, 2 zigzag slots, W-1, H*K] and the global positions it masks with
        t.fixed("kda", 3 * c.batch * 2 * (w - 1) * hk * a / c.tp)
        t.tok("kda", 8)
    if regime == "compiled":
        # the projections (the convs' inputs, which the conv op keeps, ops/causal_conv.py) and the convs' outputs
        # (q, k, v, which the KDA op keeps): AOTAutograd's partitioner does not recompute an opaque op, so compiled
        # blocks keep both, as eager ones do. Under CP the convs are a checkpointed plain expression (their halo):
        # the outputs are recomputed.
        t.tok("kda", (1 if c.cp > 1 else 2) * 3 * hk * a
              + 4 * hk + 4 * hk * a  # decay (FP32); f_b, KDA output, g_b, o_norm output
              + 4 * h + h * a, heads=True)  # o_norm rsqrt, beta
        # f_a/g_a outputs; with document ids the convs' positions in the document (the op builds its tap masks)
        # and the ids the KDA op keeps
        t.tok("kda", 2 * k * a + (16 if c.document_masking else 0))
        t.tok("block_out", d * a)  # o_proj output
        return
    if not c.fp32_params:
        t.fixed("kda", k * 4)  # the o_norm weight's .float() copy (the conv op takes its weight as it is)
    t.tok("kda", 3 * hk * a  # the convs' inputs (ops/causal_conv.py recomputes the rest)
          + 3 * hk * a  # q, k, v (the kernel's inputs)
          + hk * a + 4 * hk  # decay (kda_gate.py): the gate output; the kernel's g
          + h * a  # beta
          + 2 * hk * a + 4 * h  # gated RMSNorm (gated_norm.py): the KDA output and the gate; rsqrt
          + hk * a, heads=True)  # o_proj input
    # the projections' input, f_a/g_a outputs; with document ids the convs' positions in the document and the ids
    t.tok("kda", d * a + 2 * k * a + (16 if c.document_masking else 0))


def selected_tokens(args: Glm5ModelArgs, keys: int) -> int:
    """K: tokens each query attends on the sparse path (the selected pools' tokens, then the incomplete tail)."""
    pools = min(args.index_topk // args.index_kpool, keys // args.index_kpool)
    return pools * args.index_kpool + (args.index_kpool - 1 if args.index_kpool_always_select_tail else 0)


def _dsa(t: _Terms, regime: str, *, indexer: bool) -> None:
    """The DSA block: q/kv latents, the absorbed sparse MLA (ops/sparse_mla.py) over the indexer's token indices,
    the indexer's tiled top-k and KL (ops/indexer_topk.py, ops/indexer_kl.py: the KL's gradients are formed in the
    forward and kept). In the dense warm-up stage (`dsa_attention="dense"`), and for rows of at most
    `dsa_dense_max_len` tokens, masked SDPA instead.

    Context parallelism (dsa.py): the latent and the indexer's per-token keys and gate logits are all-gathered over
    the cp ranks (each unshard keeps its [T] int64 zigzag index), the attention keeps the gathered latent, the
    pooling runs over the whole rows, and the indexer's top-k / KL run once per zigzag chunk (2), each keeping its
    own whole-row pooled-key gradient. Checked against captures under gloo (tests/distributed/test_planner_cp.py)."""
    c, a = t.ctx, t.ctx.act
    args = c.args
    d, h = args.hidden_size, args.num_attention_heads
    dqk, dv, ql, kvl = args.qk_head_dim, args.v_head_dim, args.q_lora_rank, args.kv_lora_rank
    ih, idim, kp = args.index_n_heads, args.index_head_dim, args.index_kpool
    keys = c.keys
    sparse = args.dsa_attention == "sparse"  # the indexer selects (token indices exist)
    dense_kernel = args.dense_dsa_kernel(keys)  # masked SDPA (the dense stage, or rows <= dsa_dense_max_len)
    big_k = selected_tokens(args, keys)
    k_pools = min(args.index_topk // kp, keys // kp)
    kl = indexer and c.collect_stats  # the indexer's KL runs (and keeps its gradients) only in training
    kl_grads = 4 * ih * idim + 4 * ih  # dq, dw (per token); dpk (per pool of the row, per query chunk): kl_dpk
    cp = c.cp > 1
    gathers = (1 + (2 if indexer and (sparse or kl) else 0)) if cp else 0  # latent (+ indexer keys and gates)
    if regime == "full":
        return

    def kl_dpk() -> None:
        t.key("indexer", (2 if cp else 1) * 4 * idim / kp)

    def latent(per_token_copies: int, name: str) -> None:
        """The attention's latent (with `per_token_copies - 1` other local copies): the local one, or under CP the
        gathered rows, plus each unshard's [T] int64 zigzag index."""
        if cp:
            t.tok(name, (per_token_copies - 1) * kvl * a)
            t.key("attention", kvl * a)
            t.fixed("attention", 8 * keys * gathers)
        else:
            t.tok(name, per_token_copies * kvl * a)
    if regime == "selective":  # matmul/bmm outputs and the custom ops' outputs (not recomputable)
        # recompute_modules: mla_up_proj drops q_b (and the dense kernel's kv_b), sparse_attn the attention op's
        # output and lse, indexer everything the indexer keeps (one int64 [B, T] index stays for its recompute)
        up, attn = not c.recomputes("mla_up_proj"), not c.recomputes("sparse_attn")
        t.tok("mla", (ql + kvl + d) * a)  # q_a, kv_a, o_proj (under CP the gathers are recomputed in the backward)
        t.tok("mla", h * dqk * a * up, heads=True)  # q_b
        if not dense_kernel:  # absorbed q, w_uv; the output and lse
            t.tok("attention", h * kvl * a + h * dv * a + (h * kvl * a + 4 * h) * attn, heads=True)
        else:  # kv_b; the SDPA output and lse
            t.tok("attention", h * (dqk + dv) * a * up + (h * dv * a + 4 * h) * attn, heads=True)
        if c.recomputes("indexer"):
            if (sparse and indexer) or kl:
                t.tok("indexer", 8)
            return
        if sparse and indexer:
            t.tok("indexer", 8 * k_pools)  # the selected pool ids
        if kl:
            t.tok("indexer", 2 * idim * a + kl_grads)  # wk and KPool gate outputs; the KL's gradients
            kl_dpk()
        return
    if regime == "compiled":
        t.tok("mla", 2 * ql * a + 2 * 4)  # q_a output and its normalised copy, rsqrt
        latent(2, "mla")  # kv_a output and its normalised copy (the attention's latent)
        t.tok("mla", h * dqk * a + h * dv * a, heads=True)  # q_b output, o_proj input
        if sparse:
            t.tok("attention", 4 * big_k)  # int32 token indices
        if not dense_kernel:
            t.tok("attention", 2 * h * kvl * a + 4 * h, heads=True)  # absorbed q, output, lse
        else:
            t.tok("attention", (h * (dqk + dv) + h * dv) * a + 4 * h, heads=True)  # kv_b, SDPA output, lse
            if c.dsa_mask:
                t.tok("attention", keys)  # the boolean mask
        t.tok("block_out", d * a)
        if kl:
            t.tok("indexer", kl_grads + 8)  # the KL's gradients, LN stats
            (t.key if cp else t.tok)("indexer", 2 * idim * a + 8)  # wk/gate outputs (gathered under CP), slot ids
            kl_dpk()
        return
    # eager
    t.tok("mla", d * a + (4 * ql + 4 + ql * a) + ql * a + (4 * kvl + 4 + kvl * a))  # input, q_a/kv_a norms, qr
    t.tok("mla", h * dqk * a + h * dv * a, heads=True)  # q_b output (absorption), o_proj input
    if sparse:
        t.tok("attention", 4 * big_k)  # int32 token indices
    if not dense_kernel:
        t.tok("attention", 2 * h * kvl * a + 4 * h, heads=True)
    else:
        t.tok("attention", (h * (dqk + dv) + h * dv) * a + 4 * h, heads=True)
        if c.dsa_mask:
            t.tok("attention", keys * a)  # the float bias
    latent(1, "attention")
    if kl:
        if not c.fp32_params:
            t.fixed("indexer", kp * idim * 4)
        acc = 8 * idim if args.kpool_fp32_accumulate else 4 * idim + 2 * idim * a
        t.tok("indexer", kl_grads + idim * a + 2 * a)  # gradients; wk output, LN stats
        t.key("indexer", 8 + acc)  # the pools' token ids; the KPool softmax over the (whole) rows
        kl_dpk()


def _dense_mlp(t: _Terms, regime: str, width: int, name: str) -> None:
    a, d = t.ctx.act, t.ctx.args.hidden_size
    if regime == "full" or (regime == "selective" and name == "mlp" and t.ctx.recomputes("mlp")):
        return
    if regime == "selective":
        t.tok(name, 2 * width * a, heads=True)  # gate, up outputs
        t.tok(name, d * a)  # down output
    elif regime == "compiled":
        t.tok(name, 3 * width * a, heads=True)  # gate, up, their SwiGLU product
    else:
        t.tok(name, 3 * width * a, heads=True)  # gate and up (layers.swiglu keeps only those), down input
        t.tok(name, d * a)  # input


def _moe(t: _Terms, regime: str) -> None:
    c, a = t.ctx, t.ctx.act
    args = c.args
    d, e, k, ie = args.hidden_size, args.n_routed_experts, args.num_experts_per_tok, args.moe_intermediate_size
    shared = ie * args.n_shared_experts
    if regime == "full" or (regime == "selective" and c.recomputes("moe")):
        return
    if regime == "selective":  # router matmul, shared expert GEMMs; the grouped GEMMs are recomputed
        t.tok("router", 4 * e)
        _dense_mlp(t, regime, shared, "shared_expert")
        return
    if not c.fp32_params:
        t.fixed("router", e * d * 4)  # weight.float()
    if regime == "compiled":
        t.tok("router", 4 * d + 4 * e + 2 * 8 * k + 4 * k + 2 * k)  # FP32 input, logits, ids and order, weights
        # gathered rows, down output; gate, up, SwiGLU (with moe_chunk_tokens: one chunk's, alive while it is
        # recomputed in backward)
        t.tok("experts", (2 * k * d * a + 3 * k * ie * a) * c.expert_share)
        _dense_mlp(t, regime, shared, "shared_expert")
        t.tok("block_out", d * a)  # the MoE output (the combine sums the saved rows: no buffer of its own)
        return
    t.tok("router", 4 * d + 4 * e + 8 * k + 4 * k + 4)  # FP32 input, sigmoid, top-k ids, weights, norm
    # (the grouped SwiGLU keeps gate and up: layers.swiglu)
    t.tok("experts", (2 * 8 * k + 2 * k + 3 * k * d * a + k * ie * a + 2 * k * ie * a) * c.expert_share)
    _dense_mlp(t, regime, shared, "shared_expert")


# --------------------------------------------------------------------------------------------- blocks
def saved(kind: str, regime: str, ctx: ActContext, *, shared_indexer: bool = False) -> dict[str, float]:
    """Bytes one block keeps from its forward to its backward, by term (kind: kda_dense | kda_moe | dsa_dense |
    dsa_moe | mtp)."""
    if regime not in REGIMES:
        raise ValueError(f"unknown regime {regime!r}; choose from {REGIMES}")
    t = _Terms(ctx)
    args, a = ctx.args, ctx.act
    d, n = args.hidden_size, args.hc_mult
    # [B, T] int64 inputs a checkpointed block keeps: document ids and positions (full AC: the DSA blocks' document
    # keys too); without document ids a KDA block gets neither (a DSA block makes its own from the row)
    ints = 8 * (3 if regime == "full" and ("dsa" in kind or kind == "mtp") else 2)
    if kind.startswith("kda") and not ctx.document_masking:
        ints = 0
    if ctx.cp > 1 and regime == "full":
        ints = 0  # captured under CP: the checkpoint records no int64 input (tests/distributed/test_planner_cp.py)
    if regime == "full" and ctx.offload_inputs:
        return t.out  # the inputs wait in host memory (activation_checkpoint.HostOffload)
    if kind == "mtp":
        if regime != "eager":  # trunk hidden states, next-token embeddings (eager keeps their FP32 copies instead)
            t.tok("inputs", 2 * d * a + (ints if regime in ("full", "selective") else 0))
        if regime == "full":
            return t.out
        if regime == "compiled":
            t.tok("mtp", 2 * d * a + 5 * d * a + 5 * 4)  # eh_proj input; x, x + a, x + m and two norm outputs
        elif regime == "eager":
            t.tok("mtp", 5 * (4 * d + 4 + d * a) + 2 * d * a)  # five norms, the eh_proj input
        else:
            t.tok("mtp", d * a)  # eh_proj output
        _dsa(t, regime, indexer=True)
        _moe(t, regime)
        if regime == "compiled":  # the residual adds need neither the attention output nor the MoE output
            t.out["block_out"] -= 2 * d * a * ctx.tokens / ctx.tp
        return t.out
    if regime == "full":
        t.tok("inputs", n * d * a + ints)
        return t.out
    if regime == "selective":
        t.tok("inputs", n * d * a + ints)
        if not ctx.compiled and not ctx.recomputes("mhc"):  # eager: the attention site's merge matmul (bmm)
            t.tok("streams", n * d * a)  # output; compiled it is pointwise
    elif regime == "compiled":
        t.tok("norms", d * a)  # the attention site's collapsed input
    for site in range(2):
        _mhc_site(t, regime, first=site == 0)
    _norm(t, regime, d)
    _norm(t, regime, d)
    if kind.startswith("kda"):
        _kda(t, regime)
    else:
        _dsa(t, regime, indexer=not shared_indexer)
    if kind.endswith("moe"):
        _moe(t, regime)
    else:
        _dense_mlp(t, regime, args.intermediate_size, "mlp")
        if regime == "compiled":
            t.tok("block_out", d * a)
    return t.out


# ----------------------------------------------------------------------------------------- working sets
def offloaded_inputs(units, ctx: ActContext, *, with_mtp: bool) -> float:
    """Bytes activation_checkpoint.offload_inputs moves to pinned host memory per step and rank: what full AC saves
    of each block (its inputs), each held from the block's forward to its backward, so all at once at the turn
    (measured: 34.0 GiB at T = 128K on the proxy, docs/performance.md). `units`: the inventory's."""
    if not ctx.offload_inputs:
        return 0.0
    return sum(_block_inputs(u.kind, ctx, shared_indexer=u.shared_indexer)
               for u in units if u.kind not in ("embed", "head") and (with_mtp or u.kind != "mtp"))


def _block_inputs(kind: str, ctx: ActContext, *, shared_indexer: bool) -> float:
    """Bytes of what full AC saves of one block (its inputs), wherever offload_inputs keeps them."""
    kept = dataclasses.replace(ctx, offload_inputs=False)
    return sum(saved(kind, "full", kept, shared_indexer=shared_indexer).values())


def _per_token(ctx: ActContext, nbytes: float, *, heads: bool = False) -> float:
    return nbytes * ctx.tokens / (ctx.tp if heads else 1)


def forward_work(kind: str, regime: str, ctx: ActContext, *, shared_indexer: bool = False) -> float:
    """Bytes a block allocates during its forward beyond what it keeps (freed when it returns): under AC the
    intermediates it does not keep (its compiled or eager inventory: ActContext.running), and in every regime the
    kernels' workspaces and the indexer's query tiles. An estimate from the code (not measured per block)."""
    args, a = ctx.args, ctx.act
    work = 0.0
    if regime in ("full", "selective"):
        kept = sum(saved(kind, regime, ctx, shared_indexer=shared_indexer).values())
        work += max(0.0, sum(saved(kind, ctx.running, ctx, shared_indexer=shared_indexer).values()) - kept)
    d, n = args.hidden_size, args.hc_mult
    work += _per_token(ctx, n * d * a)  # the block's output streams
    if kind.startswith("kda"):
        h, k = args.linear_num_heads, args.linear_head_dim
        # FLA chunk_kda forward: normalised q/k, w, u, v_new, the FP32 gate cumsum and the chunk states [T/64, H, K, V]
        # (under kda_saved_states the op keeps w, u, v_new and the states: saved() counts them)
        transient = 2 * h * k * a + 4 * h * k
        work += _per_token(ctx, transient if ctx.kda_saved_states else
                           transient + 3 * h * k * a + h * k * k * a / FLA_CHUNK, heads=True)
    if "dsa" in kind or kind == "mtp":
        work += _dsa_forward_work(ctx, indexer=not shared_indexer)
    if kind.endswith("moe") or kind == "mtp":
        # weighted expert rows (one chunk's with moe_chunk_tokens), the combine
        work += _per_token(ctx, args.num_experts_per_tok * d * a * ctx.expert_share + d * a)
    return work


def _dsa_forward_work(ctx: ActContext, *, indexer: bool) -> float:
    args, a = ctx.args, ctx.act
    if args.dense_dsa_kernel(ctx.keys) and ctx.dsa_mask:  # masked SDPA: its boolean mask and the float bias
        work = _per_token(ctx, ctx.keys * (1 + a))
    else:
        work = 0.0
    if indexer:
        # the tiled top-k and KL hold a few FP32 tiles of at most indexer_tile_elements (scores, logits,
        # probabilities), or of the whole [tokens, width] problem when that is smaller
        width = max(args.index_n_heads * ctx.pools, args.num_attention_heads * ctx.keys)
        tiles = 3 * 4 * min(args.indexer_tile_elements, ctx.tokens * width)
        if ctx.collect_stats:
            work += tiles + 4 * args.kv_lora_rank * ctx.batch * ctx.keys  # + the (whole rows') latent in FP32
        elif args.dsa_attention == "sparse":
            work += tiles / 3
    return work


def backward_work(kind: str, regime: str, ctx: ActContext, *, shared_indexer: bool = False) -> float:
    """Bytes a block allocates during its backward beyond the activations it kept: the recomputed forward under AC
    (its compiled inventory less what was kept, and under full AC the indexer's tiles again), and the gradients of
    its largest intermediates (kernel outputs, expert rows, the streams). An estimate from the code."""
    args, a = ctx.args, ctx.act
    d, n = args.hidden_size, args.hc_mult
    work = 0.0
    if regime in ("full", "selective"):
        kept = sum(saved(kind, regime, ctx, shared_indexer=shared_indexer).values())
        work += max(0.0, sum(saved(kind, ctx.running, ctx, shared_indexer=shared_indexer).values()) - kept)
        if regime == "full" and ("dsa" in kind or kind == "mtp"):
            work += _dsa_forward_work(ctx, indexer=not shared_indexer)
        if regime == "full" and ctx.offload_inputs:  # the offloaded inputs, back on the device for the recompute
            work += _block_inputs(kind, ctx, shared_indexer=shared_indexer)
    work += _per_token(ctx, 2 * n * d * a)  # gradients of the input and output streams
    if regime == "eager":
        work += _per_token(ctx, n * d * a)  # the mHC mapping's input gradient (mhc.rms_linear: BF16, FP32 in chunks)
    if kind.startswith("kda"):
        h, k = args.linear_num_heads, args.linear_head_dim
        # FLA chunk_kda backward: dq, dk, dg in FP32, dv, recomputed chunk states (kept from the forward under
        # kda_saved_states) and their FP32 gradients
        recomputed = 0 if ctx.kda_saved_states else a
        work += _per_token(ctx, 3 * 4 * h * k + h * k * a + h * k * k * (recomputed + 4) / FLA_CHUNK
                           + 2 * 4 * h * FLA_CHUNK, heads=True)
        # the short conv's reference backward (ops/causal_conv.py): x, the pre-activation, its sigmoid, g, a tap and
        # dx in FP32 over one channel chunk. Its CUDA kernel holds only dx; the term stays as the bound of the gated
        # norm's chunked backward (gated_norm.py), which holds fewer of the same size.
        work += 6 * 4 * min(_per_token(ctx, h * k, heads=True), BWD_CHUNK_ELEMENTS)
    if "dsa" in kind or kind == "mtp":
        h, dqk, dv, kvl = args.num_attention_heads, args.qk_head_dim, args.v_head_dim, args.kv_lora_rank
        if args.dsa_attention == "sparse":  # d(absorbed q), d(q_b output), d(o_proj input); FP32 d(latent)
            # (under CP the latent's gradient covers the whole rows before its reduce-scatter)
            work += _per_token(ctx, (h * kvl + h * dqk + h * dv) * a, heads=True) + 4 * kvl * ctx.batch * ctx.keys
        else:  # dq, dk, dv; the bias again
            work += _per_token(ctx, h * (2 * dqk + dv) * a, heads=True) + _per_token(ctx, ctx.keys * a)
    if kind.endswith("moe") or kind == "mtp":
        k, ie = args.num_experts_per_tok, args.moe_intermediate_size
        # gradients of the expert rows and of gate/up (one chunk's with moe_chunk_tokens)
        work += _per_token(ctx, (2 * k * d * a + 2 * k * ie * a) * ctx.expert_share)
    elif kind.endswith("dense"):
        work += _per_token(ctx, 2 * args.intermediate_size * a, heads=True)
    return work
