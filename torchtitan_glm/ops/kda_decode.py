"""KDA for incremental decode (forward only): a chunked prefill that also returns each row's final state, and the
recurrent step that continues from a state.

    kda_prefill(q, k, v, g, beta, seq_idx, safe_gate) -> (o [B, T, H, V], state [B, H, K, V] FP32)
    kda_step(q, k, v, g, beta, state) -> (o [B, T, H, V], new state [B, H, K, V] FP32)

Same contract as ops/kda.py's `kda` (raw q, k: L2-normalised and q scaled by K^-1/2 inside). `state` of
kda_prefill is the state after the last token of each row, i.e. of the row's last document (`seq_idx` restarts the
state where it changes, as in training): a prompt left-padded with a padding document before it. kda_step runs T
(usually 1) more tokens of one document per row from `state`.

CPU: the torch reference of ops/kda.py (the same chunked scan the training forward runs, so a prefill's outputs are
the training forward's bit for bit; a step is that scan over one chunk of T tokens, which for T = 1 is exactly the
recurrence S <- diag(exp g) S; S <- S + k (beta (v - k^T S))^T; o = q^T S). CUDA: FLA's chunk_kda_fwd with
output_final_state (prefill) and fused_recurrent_kda (step), the kernels serving engines run for KDA decode.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .kda import _chunk_scan, _fla_chunk_fwd, _segments, normalize_qk

__all__ = ["kda_prefill", "kda_prefill_reference", "kda_step", "kda_step_reference"]


def kda_prefill_reference(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, seq_idx: Tensor | None = None,
                          *, chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """Torch reference of kda_prefill: ops.kda.kda_reference's scan, keeping each row's final state."""
    qf, kf = normalize_qk(q, k)
    vf, gf, bf = v.float(), g.float(), beta.float()
    if seq_idx is None:
        o, state = _chunk_scan(qf, kf, vf, gf, bf, chunk_size)
        return o.to(v.dtype).contiguous(), state
    rows, states = [], []
    for b in range(q.shape[0]):
        parts = []
        for s, e in _segments(seq_idx[b]):
            o, state = _chunk_scan(qf[b:b + 1, s:e], kf[b:b + 1, s:e], vf[b:b + 1, s:e], gf[b:b + 1, s:e],
                                   bf[b:b + 1, s:e], chunk_size)
            parts.append(o)
        rows.append(torch.cat(parts, 1))
        states.append(state)  # the last segment's: the row's last document
    return torch.cat(rows, 0).to(v.dtype).contiguous(), torch.cat(states, 0)


def kda_step_reference(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                       state: Tensor) -> tuple[Tensor, Tensor]:
    """Torch reference of kda_step: the scan over one chunk of the T new tokens from `state`."""
    qf, kf = normalize_qk(q, k)
    o, new_state = _chunk_scan(qf, kf, v.float(), g.float(), beta.float(), max(1, q.shape[1]), state.float())
    return o.to(v.dtype).contiguous(), new_state


def _fla_prefill(q, k, v, g, beta, seq_idx, safe_gate) -> tuple[Tensor, Tensor]:
    b, t, h, _ = q.shape
    cu_cpu, (o, state, *_) = _fla_chunk_fwd(q, k, v, g, beta, seq_idx, safe_gate, output_final_state=True)
    if cu_cpu is not None:  # one state per document run: keep the run ending each row
        ends = cu_cpu[1:]
        last = torch.searchsorted(ends, torch.arange(1, b + 1) * t)
        # a pageable host-to-device copy without blocking (CUDA stages the source before returning); a blocking
        # one would synchronise once per KDA layer (tests/gpu/test_host_syncs_cuda.py counts them)
        state = state[last.to(state.device, non_blocking=True)]
    return o.reshape(b, t, h, -1).to(v.dtype), state.float()


@torch.library.custom_op("torchtitan_glm::kda_prefill", mutates_args=(), device_types="cpu")
def kda_prefill(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, seq_idx: Tensor | None,
                safe_gate: bool) -> tuple[Tensor, Tensor]:
    """(o, final state of each row) of the chunked KDA (module docstring). No gradient."""
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        return kda_prefill_reference(q, k, v, g, beta, seq_idx)


@kda_prefill.register_kernel("cuda")
def _kda_prefill_cuda(q, k, v, g, beta, seq_idx, safe_gate):
    with torch.no_grad(), torch.cuda.device(q.device), torch.autocast("cuda", enabled=False):
        return _fla_prefill(q, k, v, g, beta, seq_idx, safe_gate)


@kda_prefill.register_fake
def _kda_prefill_fake(q, k, v, g, beta, seq_idx, safe_gate):
    b, _, h, dk = q.shape
    return torch.empty_like(v, memory_format=torch.contiguous_format), q.new_empty(b, h, dk, v.shape[-1],
                                                                                   dtype=torch.float32)


@torch.library.custom_op("torchtitan_glm::kda_step", mutates_args=(), device_types="cpu")
def kda_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """(o, new state) of T more tokens per row from `state` (module docstring). No gradient."""
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        return kda_step_reference(q, k, v, g, beta, state)


@kda_step.register_kernel("cuda")
def _kda_step_cuda(q, k, v, g, beta, state):
    from fla.ops.kda import fused_recurrent_kda

    with torch.no_grad(), torch.cuda.device(q.device), torch.autocast("cuda", enabled=False):
        o, new_state = fused_recurrent_kda(q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(),
                                           beta.contiguous(), scale=q.shape[-1] ** -0.5,
                                           initial_state=state.float().contiguous(), output_final_state=True,
                                           use_qk_l2norm_in_kernel=True)
        return o.to(v.dtype), new_state


@kda_step.register_fake
def _kda_step_fake(q, k, v, g, beta, state):
    return torch.empty_like(v, memory_format=torch.contiguous_format), torch.empty_like(state, dtype=torch.float32)
