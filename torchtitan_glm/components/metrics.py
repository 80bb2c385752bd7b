"""Training metrics: FLOPs per token of GLM-5.3-Flash, throughput/MFU, device memory, console lines, TensorBoard.

FLOPs per token (training, forward + backward), `flops_breakdown(args, seq_len)`:

  params  = 6 * N_active, N_active = parameters one token touches, embedding excluded: every decoder layer's
            mHC mappings (fn, base, scale), norms, KDA projections/convs/gates or MLA + indexer projections (incl. the
            KPool gate/APE), dense MLP or MoE router + shared experts + the top-k routed experts only, the final norm,
            the MTP layer (eh_proj, norms, its DSA layer and MoE), and the LM head once per prediction (trunk + MTP).
  kda     = per KDA layer 3 * 4 * H * K * V: the state update and the readout are 2 * K * V flops each per head in
            the forward, x3 for forward + backward (chunk-local terms of the chunked kernel are not counted).
  dsa     = per DSA layer (MTP's included) 3 * 2 * H * (d_qk + d_v) * mean_t n(t): QK^T and PV over the n(t) keys
            query t attends to, averaged over t = 0..seq_len-1 (one packed row taken as one document, TorchTitan's
            convention). Sparse: n(t) = min(P, index_topk // kpool) * kpool + tail, P = (t + 1) // kpool full pools,
            tail = (t + 1) % kpool when index_kpool_always_select_tail (<= index_topk + kpool - 1); dense: n = t + 1.
  indexer = per DSA layer with its own indexer (indexer_types "full"; MTP's included) 3 * 2 * index_n_heads *
            index_head_dim * mean_t P(t): the indexer scores every visible full pool.
Ignored as negligible: mHC stream mixing and Sinkhorn, norms/activations arithmetic, router top-k, the KL target.
The count assumes every parameter trains (in loss.indexer_stage="dense_warmup" the real cost is lower).
"""

from __future__ import annotations

import math
import os
import resource
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from torchtitan_glm.config import MetricsConfig

__all__ = [
    "ParamCounts", "count_params", "FlopsBreakdown", "flops_breakdown", "flops_per_token", "get_peak_flops",
    "throughput", "format_step_line", "format_eta", "MemoryStats", "DeviceMemoryMonitor", "TensorBoardLogger",
    "build_metrics_logger", "expert_load_imbalance",
]

_KDA, _DSA = "linear_attention", "indexed_attention"


# ------------------------------------------------------------------------------------------- parameters
def _kda_params(a: Any) -> int:
    d, h, k, w = a.hidden_size, a.linear_num_heads, a.linear_head_dim, a.linear_conv_kernel_dim
    hk = h * k
    projections = 3 * d * hk + 2 * (d * k + k * hk) + d * h + hk * d  # q,k,v; f_a/f_b, g_a/g_b; b; o
    return projections + 3 * hk * w + h + hk + k  # q/k/v short convs; A_log; dt_bias; o_norm


def _indexer_params(a: Any) -> int:
    d, ih, idim = a.hidden_size, a.index_n_heads, a.index_head_dim
    return a.q_lora_rank * ih * idim + d * idim + 2 * idim + d * ih + a.index_kpool * idim + idim * d


def _dsa_params(a: Any, *, with_indexer: bool) -> int:
    d, h, q, kv = a.hidden_size, a.num_attention_heads, a.q_lora_rank, a.kv_lora_rank
    bias = bool(a.attention_bias)
    n = d * q + q * bias + q + q * h * a.qk_head_dim  # q_a_proj (+bias), q_a_layernorm, q_b_proj
    n += d * (kv + a.qk_rope_head_dim) + (kv + a.qk_rope_head_dim) * bias + kv  # kv_a_proj_with_mqa, kv_a_layernorm
    n += kv * h * (a.qk_nope_head_dim + a.v_head_dim) + h * a.v_head_dim * d + d * bias  # kv_b_proj, o_proj
    return n + (_indexer_params(a) if with_indexer else 0)


def _moe_params(a: Any, *, active: bool) -> int:
    expert = 3 * a.hidden_size * a.moe_intermediate_size
    routed = a.num_experts_per_tok if active else a.n_routed_experts
    return a.n_routed_experts * a.hidden_size + (a.n_shared_experts + routed) * expert


def _hc_params(a: Any) -> int:
    n = a.hc_mult
    return (2 + n) * n * n * a.hidden_size + (2 + n) * n + 3


@dataclass(frozen=True)
class ParamCounts:
    """total: every parameter (embedding, all experts, MTP); active: non-embedding parameters one token uses
    (top-k experts only, LM head counted once per prediction head)."""

    total: int
    active: int


def count_params(args: Any) -> ParamCounts:
    """Parameter counts of a Glm5ModelArgs-like object, from its shapes alone (no model is built)."""
    d, v = args.hidden_size, args.vocab_size
    total = active = 0
    for i in range(args.num_hidden_layers):
        common = 2 * _hc_params(args) + 2 * d
        if args.layer_types[i] == _KDA:
            attn = _kda_params(args)
        else:
            attn = _dsa_params(args, with_indexer=args.indexer_types[i] == "full")
        if args.mlp_layer_types[i] == "dense":
            mlp_total = mlp_active = 3 * d * args.intermediate_size
        else:
            mlp_total, mlp_active = _moe_params(args, active=False), _moe_params(args, active=True)
        total += common + attn + mlp_total
        active += common + attn + mlp_active
    head = d + (args.hc_mult * args.hc_mult * d + args.hc_mult + 1 if args.hc_head == "learned" else 0)
    total += head + d * v + v * d  # final norm (+ learned hc head), lm_head, embedding
    active += head + d * v
    if args.num_nextn_predict_layers:
        mtp = 2 * d + 2 * d * d + 2 * d + _dsa_params(args, with_indexer=True) + d  # enorm/hnorm, eh_proj, norms
        total += mtp + _moe_params(args, active=False)
        active += mtp + _moe_params(args, active=True) + d * v  # the shared LM head runs again on MTP states
    return ParamCounts(total=total, active=active)


# ------------------------------------------------------------------------------------------------ FLOPs
@dataclass(frozen=True)
class FlopsBreakdown:
    """Training FLOPs per token by term (see the module docstring)."""

    params: float
    kda: float
    dsa: float
    indexer: float

    @property
    def total(self) -> float:
        return self.params + self.kda + self.dsa + self.indexer


def _mean_attended(args: Any, seq_len: int) -> tuple[float, float]:
    """(mean keys attended per query, mean full pools visible per query) over positions 0..seq_len-1."""
    visible = np.arange(1, seq_len + 1, dtype=np.float64)
    kpool = args.index_kpool
    pools = np.floor_divide(visible, kpool)
    if args.dsa_attention == "dense":
        attended = visible
    else:
        tail = np.mod(visible, kpool) if args.index_kpool_always_select_tail else 0.0
        attended = np.minimum(pools, args.index_topk // kpool) * kpool + tail
    return float(attended.mean()), float(pools.mean())


def flops_breakdown(args: Any, seq_len: int) -> FlopsBreakdown:
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    attended, pools = _mean_attended(args, seq_len)
    n_kda = sum(t == _KDA for t in args.layer_types)
    n_dsa = sum(t != _KDA for t in args.layer_types) + args.num_nextn_predict_layers
    n_idx = sum(t != _KDA and it == "full" for t, it in zip(args.layer_types, args.indexer_types))
    n_idx += args.num_nextn_predict_layers
    k = args.linear_head_dim
    return FlopsBreakdown(
        params=6.0 * count_params(args).active,
        kda=3.0 * 4 * args.linear_num_heads * k * k * n_kda,
        dsa=3.0 * 2 * args.num_attention_heads * (args.qk_head_dim + args.v_head_dim) * attended * n_dsa,
        indexer=3.0 * 2 * args.index_n_heads * args.index_head_dim * pools * n_idx,
    )


def flops_per_token(args: Any, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token for rows of `seq_len` tokens."""
    return flops_breakdown(args, seq_len).total


_PEAK_BF16 = (("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("H20", 148e12),
              ("A100", 312e12))


def get_peak_flops(device_name: str | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of the current (or named) GPU; None on CPU or for an unknown GPU (no MFU then)."""
    if device_name is None:
        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    for key, peak in _PEAK_BF16:
        if key in device_name:  # ordered so that e.g. "H200" is tried before "H20"
            return peak
    return None


def throughput(*, tokens: int, seconds: float, flops_per_token: float,
               peak_flops: float | None) -> tuple[float, float, float | None]:
    """(tokens/s, TFLOP/s, MFU %) of one device that processed `tokens` in `seconds`; MFU None without a peak."""
    tps = tokens / max(seconds, 1e-12)
    flops = tps * flops_per_token
    return tps, flops / 1e12, (100.0 * flops / peak_flops if peak_flops else None)


# ---------------------------------------------------------------------------------------------- console
def format_eta(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = int(round(max(seconds, 0.0)))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def format_step_line(*, step: int, total_steps: int, loss: float, tokens_per_sec: float, tflops: float | None,
                     mfu_pct: float | None, peak_mem_gib: float, eta_seconds: float | None,
                     extra: Mapping[str, float] | None = None) -> str:
    """One console line per logged step, e.g.
    `step 10/100 | loss 3.2100 | tps 12,345 | tflops 123.4 | mfu 12.5% | mem 10.25GiB | eta 1h02m | lr 3.0e-04`."""
    parts = [f"step {step}/{total_steps}", f"loss {loss:.4f}", f"tps {tokens_per_sec:,.0f}",
             f"tflops {tflops:.1f}" if tflops is not None else "tflops -",
             f"mfu {mfu_pct:.1f}%" if mfu_pct is not None else "mfu -",
             f"mem {peak_mem_gib:.2f}GiB", f"eta {format_eta(eta_seconds)}"]
    parts += [f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in (extra or {}).items()]
    return " | ".join(parts)


# ----------------------------------------------------------------------------------------------- memory
@dataclass(frozen=True)
class MemoryStats:
    max_active_gib: float
    max_reserved_gib: float
    max_active_pct: float
    max_reserved_pct: float
    num_alloc_retries: int
    num_ooms: int


class DeviceMemoryMonitor:
    """Peak memory since the last reset: CUDA allocator stats, or on CPU the process's max RSS (getrusage; it
    cannot be reset, so it is the peak since process start)."""

    _GIB = 1024**3

    def __init__(self, device: torch.device | str = "cuda") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            self.device_name, self.capacity = props.name, props.total_memory
        else:
            self.device_name = "cpu"
            self.capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        self.reset_peak_stats()

    def reset_peak_stats(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def get_peak_stats(self) -> MemoryStats:
        if self.device.type == "cuda":
            stats = torch.cuda.memory_stats(self.device)
            active, reserved = stats.get("active_bytes.all.peak", 0), stats.get("reserved_bytes.all.peak", 0)
            retries, ooms = stats.get("num_alloc_retries", 0), stats.get("num_ooms", 0)
        else:
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            active = reserved = rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux
            retries = ooms = 0
        return MemoryStats(max_active_gib=active / self._GIB, max_reserved_gib=reserved / self._GIB,
                           max_active_pct=100.0 * active / self.capacity,
                           max_reserved_pct=100.0 * reserved / self.capacity,
                           num_alloc_retries=int(retries), num_ooms=int(ooms))


# ------------------------------------------------------------------------------------------ tensorboard
class TensorBoardLogger:
    """Scalars to TensorBoard under `log_dir`; a no-op unless enabled and on rank 0 (or all_ranks, then each rank
    writes to log_dir/rank_{rank}). The event file is opened at the first logged step, so a run that trains nothing
    (it resumes at training.steps, or fails before its first step) leaves none behind; a resumed run's file purges
    what earlier files hold from its first step on (purge_from)."""

    def __init__(self, log_dir: str, *, enable: bool = True, rank: int = 0, all_ranks: bool = False) -> None:
        self.writer = None
        self._enabled = enable and (rank == 0 or all_ranks)
        self.log_dir = os.path.join(log_dir, f"rank_{rank}") if all_ranks else log_dir
        self._purge_step: int | None = None

    def purge_from(self, step: int) -> None:
        """A resumed run logs from `step` on: TensorBoard then hides the events of `step` and later that an earlier
        run wrote into this folder (SummaryWriter's purge_step), so a rewound or re-run range shows once."""
        self._purge_step = step

    @property
    def enabled(self) -> bool:
        return self._enabled

    def log(self, metrics: Mapping[str, float | int | torch.Tensor], step: int) -> None:
        if not self._enabled:
            return
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(self.log_dir, exist_ok=True)
            self.writer = SummaryWriter(self.log_dir, purge_step=self._purge_step)
        for name, value in metrics.items():
            if value is not None:
                self.writer.add_scalar(name, float(value), step)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        self._enabled = False


def build_metrics_logger(*, cfg: MetricsConfig, dump_folder: str, rank: int) -> TensorBoardLogger:
    """TensorBoard logger at dump_folder/metrics.save_tb_folder when metrics.enable_tensorboard (rank 0 only)."""
    return TensorBoardLogger(os.path.join(dump_folder, cfg.save_tb_folder), enable=cfg.enable_tensorboard, rank=rank)


# --------------------------------------------------------------------------------------------------- MoE
def expert_load_imbalance(counts: torch.Tensor | np.ndarray | Sequence[float]) -> torch.Tensor:
    """max / mean of per-expert token counts over the last dim (1.0 = perfectly balanced; 1.0 when no tokens).
    Tensor in, tensor out (shape counts.shape[:-1]), so no device sync is forced."""
    c = counts if isinstance(counts, torch.Tensor) else torch.as_tensor(np.asarray(counts))
    c = c.float()
    mean = c.mean(dim=-1)
    return torch.where(mean > 0, c.amax(dim=-1) / mean.clamp_min(1e-12), torch.ones_like(mean))
