"""Kimi Delta Attention (KDA) core: a chunked gated delta rule with per-key-dim decay.

Why hand-written: FLA's entry points (`chunk_kda`, and every `dispatch`ed kernel wrapper) carry
`torch.compiler.disable` and FLA registers no torch.library ops, so calling FLA from a compiled model
graph-breaks at every KDA layer. We wrap FLA's forward/backward pieces in a `torchtitan_glm::kda_fwd` /
`torchtitan_glm::kda_bwd` custom-op pair that compile treats as opaque nodes. FLA's own pure-torch
`naive_chunk_kda` cannot serve as the CPU kernel or test oracle: it exponentiates g_j - g_i for masked
(non-causal) pairs before masking, which overflows and gives NaN gradients for gates near -5.

Semantics (per row and head): q, k are L2-normalised over the last dim (x / sqrt(sum x^2 + 1e-6)), q is
scaled by K^-0.5, and with state S [K, V] starting at zero:
    S <- diag(exp(g_t)) S;  S <- S + k_t (beta_t (v_t - k_t^T S))^T;  o_t = q_t^T S.
`seq_idx` [B, T] (document id per token) restarts the state where it changes; every row starts fresh.
"""

import contextlib
from types import SimpleNamespace

import torch
from torch import Tensor

__all__ = ["kda", "kda_reference", "kda_segment", "kda_transition", "normalize_qk"]

_L2_EPS = 1e-6
_FLA_CHUNK = 64  # FLA's default KDA chunk; the saved Aqk/Akk residuals have this many columns


# ---------------------------------------------------------------------------------------------
# Pure-torch reference (CPU kernel and test oracle)
# ---------------------------------------------------------------------------------------------


def _l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + _L2_EPS)


def _chunk_scan(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk_size: int,
                initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Chunked (WY) gated delta rule over independent rows; fp32, q/k already normalised and scaled.

    q, k, g [N, T, H, K]; v [N, T, H, V]; beta [N, T, H]; initial_state [N, H, K, V] (zeros if None).
    Returns (o [N, T, H, V], final state [N, H, K, V]).
    Only non-positive numbers are exponentiated: pairwise decays exp(G_t - G_s) are masked to -inf
    for s > t before exp, so forward and backward stay finite however negative g gets.
    """
    n, t, h, dk = q.shape
    dv = v.shape[-1]
    c = chunk_size
    pad = (-t) % c
    if pad:  # zero padding at the end (k = v = beta = g = 0) leaves earlier outputs and the final state unchanged
        q, k, v, g = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = torch.nn.functional.pad(beta, (0, 0, 0, pad))
    nc = (t + pad) // c

    def chunked(x: Tensor) -> Tensor:  # [N, T, H, D] -> [N, H, NC, C, D]
        return x.reshape(n, nc, c, h, x.shape[-1]).permute(0, 3, 1, 2, 4)

    q, k, v, g = chunked(q), chunked(k), chunked(v), chunked(g)
    beta = chunked(beta.unsqueeze(-1))  # [N, H, NC, C, 1]
    gc = g.cumsum(-2)  # within-chunk cumulative log decay G_t

    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()  # s <= t
    diff = gc.unsqueeze(-2) - gc.unsqueeze(-3)  # [.., C(t), C(s), K]: G_t - G_s
    decay = torch.where(causal.unsqueeze(-1), diff, float("-inf")).exp()
    kk = (k.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(-1)  # sum_d k_t k_s exp(G_t - G_s)
    a_kk = (kk * beta).tril(-1)  # strictly lower: (I + A_kk) U = beta * (V - ...)
    a_qk = (q.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(-1)  # causal incl. diagonal

    g_tot = gc[..., -1:, :]  # [.., 1, K] total chunk decay
    q_dec = q * gc.exp()
    k_dec_in = k * gc.exp()  # decay from chunk start to t
    k_dec_out = k * (g_tot - gc).exp()  # decay from t to chunk end
    u_v = torch.linalg.solve_triangular(a_kk, beta * v, upper=False, unitriangular=True)
    u_s = torch.linalg.solve_triangular(a_kk, beta * k_dec_in, upper=False, unitriangular=True)

    state = q.new_zeros(n, h, dk, dv) if initial_state is None else initial_state
    outs = []
    for i in range(nc):
        u = u_v[:, :, i] - u_s[:, :, i] @ state  # [N, H, C, V] new values of this chunk
        outs.append(q_dec[:, :, i] @ state + a_qk[:, :, i] @ u)
        state = g_tot[:, :, i].exp().transpose(-1, -2) * state + k_dec_out[:, :, i].transpose(-1, -2) @ u
    o = torch.stack(outs, 2)  # [N, H, NC, C, V]
    return o.permute(0, 2, 3, 1, 4).reshape(n, nc * c, h, dv)[:, :t], state


def normalize_qk(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 q, k as the KDA core uses them: L2-normalised, q scaled by K^-1/2."""
    return _l2norm(q.float()) * q.shape[-1] ** -0.5, _l2norm(k.float())


def kda_segment(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None = None,
                *, chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """One segment (no document boundary) of the torch reference with an initial state, on normalised fp32 q, k
    (see normalize_qk): (o [N, T, H, V], final state [N, H, K, V]). Differentiable; context parallelism chains it."""
    return _chunk_scan(q, k, v.float(), g.float(), beta.float(), chunk_size, initial_state)


def kda_transition(k: Tensor, g: Tensor, beta: Tensor, *, chunk_size: int = 64) -> Tensor:
    """The segment's state transition M [N, H, K, K] (normalised fp32 k): S_end = M S_start + S_end(S_start = 0).

    The state evolves linearly, column by column (S <- (I - beta k k^T) diag(exp g) S + beta k v^T), so the scan
    with value 0 from the identity yields M (FLA's CP pre-process runs the same affine chain)."""
    n, t, h, dk = k.shape
    eye = torch.eye(dk, dtype=torch.float32, device=k.device).expand(n, h, dk, dk)
    zeros = k.new_zeros(n, t, h, dk, dtype=torch.float32)
    return _chunk_scan(zeros, k, zeros, g.float(), beta.float(), chunk_size, eye)[1]


def _segments(seq_idx_row: Tensor) -> list[tuple[int, int]]:
    """[(start, end)] of runs of equal document id in one row."""
    s = seq_idx_row.to("cpu", torch.int64)
    cut = (torch.nonzero(s[1:] != s[:-1]).flatten() + 1).tolist()
    bounds = [0, *cut, s.numel()]
    return list(zip(bounds[:-1], bounds[1:]))


def kda_reference(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, seq_idx: Tensor | None = None, *, chunk_size: int = 64
) -> Tensor:
    """Pure-torch chunked KDA (same contract as `kda`); fp32 inside, output in v.dtype.

    Numerically safe (forward and backward) for per-token gates down to -5 and beyond.
    """
    qf, kf = normalize_qk(q, k)
    vf, gf, bf = v.float(), g.float(), beta.float()
    if seq_idx is None:
        o = _chunk_scan(qf, kf, vf, gf, bf, chunk_size)[0]
    else:
        rows = []
        for b in range(q.shape[0]):
            parts = [
                _chunk_scan(qf[b:b + 1, s:e], kf[b:b + 1, s:e], vf[b:b + 1, s:e], gf[b:b + 1, s:e],
                            bf[b:b + 1, s:e], chunk_size)[0]
                for s, e in _segments(seq_idx[b])
            ]
            rows.append(torch.cat(parts, 1))
        o = torch.cat(rows, 0)
    return o.to(v.dtype).contiguous()


# ---------------------------------------------------------------------------------------------
# FLA (CUDA) pieces, imported lazily: FLA needs triton at import time
# ---------------------------------------------------------------------------------------------


def _fla() -> SimpleNamespace:
    """The FLA 0.6 internals that ChunkKDAFunction itself calls (imported on first CUDA use)."""
    from fla.modules.norm.l2norm import l2norm_bwd, l2norm_fwd
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd
    from fla.ops.kda.chunk_fwd import chunk_kda_fwd
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2
    from fla.ops.utils.index import prepare_chunk_indices

    return SimpleNamespace(
        l2norm_fwd=l2norm_fwd, l2norm_bwd=l2norm_bwd, chunk_kda_fwd=chunk_kda_fwd, chunk_kda_bwd=chunk_kda_bwd,
        chunk_local_cumsum=chunk_local_cumsum, RCP_LN2=RCP_LN2, prepare_chunk_indices=prepare_chunk_indices,
    )


def _chunk_indices(cu_seqlens: Tensor, chunk: int) -> Tensor:
    """[n_chunks, 2] (sequence, chunk within it) for every `chunk`-token chunk of the varlen sequences, on the host:
    what FLA's prepare_chunk_indices computes, without its blocking host-to-device copy."""
    counts = (cu_seqlens[1:] - cu_seqlens[:-1] + chunk - 1) // chunk
    seq = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    first = torch.cumsum(counts, 0) - counts
    return torch.stack([seq, torch.arange(seq.numel()) - first[seq]], 1)


def _varlen(seq_idx: Tensor | None, device: torch.device) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(cu_seqlens, cu_seqlens_cpu, chunk_indices) for FLA's flattened varlen mode; Nones without seq_idx.

    Built on the host and copied without blocking. seq_idx on the host (BatchLayout.kda_seq_idx: the loader's
    tensor) costs no host sync; on the device it is copied back first, which is one.
    """
    if seq_idx is None:
        return None, None, None
    s = seq_idx.to("cpu", torch.int64)
    start = torch.ones_like(s, dtype=torch.bool)
    start[:, 1:] = s[:, 1:] != s[:, :-1]
    cu_cpu = torch.cat([torch.nonzero(start.flatten()).flatten(), torch.tensor([s.numel()])])
    chunk_indices = _chunk_indices(cu_cpu, _FLA_CHUNK)
    # pageable host-to-device copies: CUDA stages the source before returning, so the host tensors may go
    return cu_cpu.to(device, non_blocking=True), cu_cpu, chunk_indices.to(device, non_blocking=True)


def _flat(x: Tensor, varlen: bool) -> Tensor:
    """Contiguous, and [B, T, ...] -> [1, B*T, ...] in varlen mode."""
    x = x.contiguous()
    return x.reshape(1, -1, *x.shape[2:]) if varlen else x


def _fla_chunk_fwd(q, k, v, g, beta, seq_idx, safe_gate, **kwargs) -> tuple[Tensor | None, tuple]:
    """FLA's chunk_kda_fwd on the op's raw inputs (flattened to varlen with seq_idx, q and k L2-normalised):
    (cu_seqlens_cpu, its outputs). Shared by the training forward and the decode prefill."""
    fla = _fla()
    cu, cu_cpu, chunk_indices = _varlen(seq_idx, q.device)
    scale = q.shape[-1] ** -0.5
    q, k, v, g, beta = (_flat(x, cu is not None) for x in (q, k, v, g, beta))
    qn, _ = fla.l2norm_fwd(q, eps=_L2_EPS)
    kn, _ = fla.l2norm_fwd(k, eps=_L2_EPS)
    return cu_cpu, fla.chunk_kda_fwd(
        q=qn, k=kn, v=v, g=g, beta=beta, scale=scale, initial_state=None, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
        chunk_indices=chunk_indices, chunk_size=_FLA_CHUNK, safe_gate=safe_gate, **kwargs,
    )


def _fla_fwd(q, k, v, g, beta, seq_idx, safe_gate, save_states=False) -> tuple[Tensor, list[Tensor]]:
    b, t, h, _ = q.shape
    _, outputs = _fla_chunk_fwd(q, k, v, g, beta, seq_idx, safe_gate, output_final_state=False,
                                disable_recompute=save_states)
    o, _, _, a_qk, a_kk, w, u, qg, kg, v_new, states, _ = outputs
    # Aqk/Akk (the intra-chunk solve) are the expensive residuals; the rest is recomputed in backward
    # (as FLA's own autograd does, plus the cheap l2norm and gate cumsum). FLA leaves Aqk's non-causal
    # entries unwritten (torch.empty), so their values are arbitrary; only the causal part is ever read.
    residuals = [a_qk.reshape(b, t, h, -1), a_kk.reshape(b, t, h, -1)]
    if save_states:  # FLA's disable_recompute: its backward reuses these instead of recomputing them
        residuals += [w, u, qg, kg, v_new, states]
    return o.reshape(b, t, h, -1).to(v.dtype), residuals


def _fla_bwd(do, q, k, v, g, beta, seq_idx, residuals, safe_gate) -> tuple[Tensor, ...]:
    fla = _fla()
    b, t, h, dk = q.shape
    cu, _, chunk_indices = _varlen(seq_idx, q.device)
    varlen = cu is not None
    shapes_dtypes = [(x.shape, x.dtype) for x in (q, k, v, g, beta)]
    do, q, k, v, g, beta = (_flat(x, varlen) for x in (do, q, k, v, g, beta))
    a_qk, a_kk = (_flat(x, varlen) for x in residuals[:2])
    saved = dict(zip(("w", "u", "qg", "kg", "v_new", "h"), residuals[2:]))  # save_states: FLA's intermediates
    qn, q_rstd = fla.l2norm_fwd(q, eps=_L2_EPS)
    kn, k_rstd = fla.l2norm_fwd(k, eps=_L2_EPS)
    g_cum = fla.chunk_local_cumsum(  # exactly as chunk_kda_fwd: log2 units, fp32
        g, chunk_size=_FLA_CHUNK, scale=fla.RCP_LN2, cu_seqlens=cu, chunk_indices=chunk_indices
    )
    dq, dk_, dv, db, dg, *_ = fla.chunk_kda_bwd(
        q=qn, k=kn, v=v, beta=beta, Aqk=a_qk, Akk=a_kk, scale=dk**-0.5, initial_state=None, do=do, dht=None,
        g=g_cum, cu_seqlens=cu, chunk_indices=chunk_indices, chunk_size=_FLA_CHUNK, safe_gate=safe_gate,
        disable_recompute=bool(saved), **saved,
    )
    dq = fla.l2norm_bwd(qn, q_rstd, dq, eps=_L2_EPS)
    dk_ = fla.l2norm_bwd(kn, k_rstd, dk_, eps=_L2_EPS)
    return tuple(d.reshape(s).to(dt) for d, (s, dt) in zip((dq, dk_, dv, dg, db), shapes_dtypes))


@contextlib.contextmanager
def _autograd_inside_kernel():
    """Custom-op kernels run with the autograd dispatch keys excluded, so autograd would record nothing;
    re-include them (and grad mode) for the CPU backward's recompute-and-differentiate."""
    keys = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (keys.AutogradFunctionality, keys.AutogradOther, keys.AutogradNestedTensor):
        exclude = exclude.remove(key)
    include = torch._C._dispatch_tls_local_include_set()
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        yield


def _ref_bwd(do, q, k, v, g, beta, seq_idx) -> tuple[Tensor, ...]:
    inputs = [x.detach().requires_grad_(True) for x in (q, k, v, g, beta)]
    with _autograd_inside_kernel():
        o = kda_reference(*inputs, seq_idx)
        grads = torch.autograd.grad(o, inputs, do.to(o.dtype))
    return tuple(d.contiguous() for d in grads)


# ---------------------------------------------------------------------------------------------
# Custom ops
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("torchtitan_glm::kda_fwd", mutates_args=(), device_types="cpu")
def kda_fwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, seq_idx: Tensor | None, safe_gate: bool,
    save_states: bool,
) -> tuple[Tensor, list[Tensor]]:
    """KDA forward: returns (o, residuals for kda_bwd). CPU: torch reference, no residuals (save_states has
    nothing to save there: the CPU backward differentiates the reference)."""
    _check_save_states(save_states, seq_idx)
    with torch.autocast("cpu", enabled=False):
        return kda_reference(q, k, v, g, beta, seq_idx), []


def _check_save_states(save_states: bool, seq_idx: Tensor | None) -> None:
    if save_states and seq_idx is not None:
        raise ValueError("KDA save_states (activation_checkpoint.kda_disable_recompute) needs rows without document "
                         "ids (data.document_masking = false): with documents FLA's chunk states number one per "
                         "chunk of each document, a count the compiled graph cannot know in advance")


@kda_fwd.register_kernel("cuda")
def _kda_fwd_cuda(q, k, v, g, beta, seq_idx, safe_gate, save_states):
    _check_save_states(save_states, seq_idx)
    with torch.cuda.device(q.device), torch.autocast("cuda", enabled=False):
        return _fla_fwd(q, k, v, g, beta, seq_idx, safe_gate, save_states)


@kda_fwd.register_fake
def _kda_fwd_fake(q, k, v, g, beta, seq_idx, safe_gate, save_states):
    _check_save_states(save_states, seq_idx)
    o = torch.empty_like(v, memory_format=torch.contiguous_format)
    if q.device.type != "cuda":
        return o, []
    # FLA's Aqk and Akk: [B, T, H, chunk] in k's dtype (viewed back from the varlen [1, B*T, H, chunk])
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    residuals = [k.new_empty(b, t, h, _FLA_CHUNK), k.new_empty(b, t, h, _FLA_CHUNK)]
    if save_states:  # w, u, qg, kg, v_new (u and v_new in v's dtype) and the chunk states [B, T/64, H, K, V]
        residuals += [k.new_empty(b, t, h, dk), v.new_empty(b, t, h, dv), k.new_empty(b, t, h, dk),
                      k.new_empty(b, t, h, dk), v.new_empty(b, t, h, dv),
                      k.new_empty(b, -(-t // _FLA_CHUNK), h, dk, dv)]
    return o, residuals


@torch.library.custom_op("torchtitan_glm::kda_bwd", mutates_args=(), device_types="cpu")
def kda_bwd(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, seq_idx: Tensor | None,
    residuals: list[Tensor], safe_gate: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """KDA backward: (dq, dk, dv, dg, dbeta). CPU: recompute the reference and differentiate it."""
    with torch.autocast("cpu", enabled=False):
        return _ref_bwd(do, q, k, v, g, beta, seq_idx)


@kda_bwd.register_kernel("cuda")
def _kda_bwd_cuda(do, q, k, v, g, beta, seq_idx, residuals, safe_gate):
    with torch.cuda.device(q.device), torch.autocast("cuda", enabled=False):
        return _fla_bwd(do, q, k, v, g, beta, seq_idx, residuals, safe_gate)


@kda_bwd.register_fake
def _kda_bwd_fake(do, q, k, v, g, beta, seq_idx, residuals, safe_gate):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v, g, beta))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, g, beta, seq_idx, safe_gate, _save_states = inputs
    _, residuals = output
    ctx.mark_non_differentiable(*residuals)
    ctx.save_for_backward(q, k, v, g, beta, seq_idx, *residuals)
    ctx.safe_gate = safe_gate


def _backward(ctx, do, _dresiduals):
    q, k, v, g, beta, seq_idx, *residuals = ctx.saved_tensors
    grads = torch.ops.torchtitan_glm.kda_bwd(do, q, k, v, g, beta, seq_idx, residuals, ctx.safe_gate)
    return (*grads, None, None, None)


torch.library.register_autograd("torchtitan_glm::kda_fwd", _backward, setup_context=_setup_context)


def kda(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, seq_idx: Tensor | None = None, *, safe_gate: bool,
    save_states: bool = False,
) -> Tensor:
    """KDA core (see module docstring). q, k [B,T,H,K] raw; v [B,T,H,V]; g [B,T,H,K] log decay (<= 0);
    beta [B,T,H] in (0,1); seq_idx [B,T] int or None. Returns o [B,T,H,V] in v.dtype.

    safe_gate: gates are known to lie in [-5, 0) (enables FLA's faster bounded-gate path on CUDA).
    save_states: on CUDA the forward keeps FLA's intermediates (WY factors w and u, gated q and k, the new values
    and the chunk states: (3K + 2V) x 2 bytes per token-head plus K x V x 2 per 64-token chunk-head in BF16) and
    the backward reuses them instead of recomputing them (FLA's disable_recompute): less backward time for more
    activation memory. Needs seq_idx None (see _check_save_states); the result is the same either way.
    """
    o, _ = torch.ops.torchtitan_glm.kda_fwd(q, k, v, g, beta, seq_idx, safe_gate, save_states)
    return o
