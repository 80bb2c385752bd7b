"""The machine a plan assumes: memory, measured kernel rates and stated network bandwidths.

Measured figures come from one H200 (shared/reference/measured_h200.md, docs/performance.md); the network figures
are assumptions (no multi-GPU run has been measured), listed with every plan so a reader can replace them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model and its node. Rates in FLOP/s, bandwidths in bytes/s (per GPU, one direction)."""

    name: str
    memory_bytes: float  # what torch reports as total_memory
    peak_bf16: float  # dense BF16 peak, the trainer's MFU denominator (metrics.get_peak_flops)
    gemm_bf16: float  # measured large BF16 GEMM
    gemm_grouped_bf16: float  # measured MoE grouped GEMM (proxy profile)
    fp8_speedup_tensorwise: float  # measured Float8 MLP speed-up over BF16 (torchao, compiled)
    fp8_speedup_rowwise: float
    fp8_speedup_grouped: float  # measured torchao FP8 rowwise grouped GEMM kernels over BF16's, casts not counted
    fp8_cast_efficiency: float  # measured torchao scale-and-cast kernels' bytes per second, a fraction of HBM's
    gemm_fp32: float  # measured FP32 (SIMT) GEMM: the indexer scores and KL target run in FP32
    attention_masked: float  # measured dense masked attention (cuDNN, boolean mask), FLOP/s over all T x T pairs
    attention_sparse: float  # measured: the sparse absorbed-MLA Triton kernels, FLOP/s over the T x K gathered pairs
    attention_causal: float  # measured causal SDPA (flash, no mask), FLOP/s over the causal pairs
    kda_fwd_bwd_s_per_token_head: float  # measured FLA chunk_kda forward + backward
    kda_fwd_s_per_token_head: float  # measured FLA chunk_kda forward alone
    fused_ce_s_per_token: float  # measured fused LM-head CE forward + backward, D=4096, vocab=154880
    hbm_bandwidth: float  # measured device-to-device copy (bytes read + written per second)
    gpus_per_node: int
    nvlink_busbw: float  # assumption: NCCL all-gather/reduce-scatter bus bandwidth inside a node
    ib_busbw: float  # assumption: the same across nodes (one 400 Gb/s NIC per GPU)
    a2a_efficiency: float  # assumption: all-to-all bandwidth as a fraction of the bus bandwidth of its span
    collective_latency_s: float  # assumption: fixed cost per collective call
    host_link: float  # assumption: pinned host <-> device copies, one direction (activation_checkpoint.offload_inputs)
    # measured (derived): memory-bound time per token and decoder block by AC regime, the proxy benchmark's step
    # less every modelled term (docs/performance.md, planner section)
    elementwise_s_per_token_block: dict = dataclasses.field(default_factory=dict)
    # measured: train.py's optimizer step per trainable element, by "<optimizer.name> <implementation>" (the others:
    # a bytes model)
    optimizer_s_per_param: dict = dataclasses.field(default_factory=dict)
    # measured: FSDP2's own copies and casts around its collectives, per element a rank gathers (forward and again
    # for backward) and per gradient element it reduces
    fsdp_gather_copy_s_per_elem: float = 0.0
    fsdp_reduce_copy_s_per_elem: float = 0.0

    def assumptions(self) -> list[str]:
        g = 1e9
        return [
            f"GPU {self.name}: {self.memory_bytes / GIB:.1f} GiB, dense BF16 peak {self.peak_bf16 / 1e12:.0f} TFLOP/s "
            "(the trainer's MFU denominator)",
            f"measured: BF16 GEMM {self.gemm_bf16 / 1e12:.0f} TFLOP/s, MoE grouped GEMM "
            f"{self.gemm_grouped_bf16 / 1e12:.0f} TFLOP/s, FP8 speed-up x{self.fp8_speedup_tensorwise} tensorwise / "
            f"x{self.fp8_speedup_rowwise} rowwise (Float8Linear MLP), routed experts' FP8 grouped GEMM kernels "
            f"x{self.fp8_speedup_grouped} with their casts at {self.fp8_cast_efficiency:.0%} of HBM speed (an H100's), "
            f"FP32 GEMM {self.gemm_fp32 / 1e12:.0f} TFLOP/s, masked attention "
            f"{self.attention_masked / 1e12:.0f} TFLOP/s (all T x T pairs), causal attention "
            f"{self.attention_causal / 1e12:.0f} TFLOP/s (causal pairs), sparse DSA attention "
            f"{self.attention_sparse / 1e12:.0f} TFLOP/s (T x K gathered pairs), FLA KDA "
            f"{self.kda_fwd_bwd_s_per_token_head * 1e9:.1f} ns per token-head fwd+bwd, fused CE "
            f"{self.fused_ce_s_per_token * 1e6:.2f} us per token, HBM {self.hbm_bandwidth / 1e12:.1f} TB/s; "
            + ", ".join(f"{k} step {v * 1e12:.1f} ps" for k, v in self.optimizer_s_per_param.items())
            + f" per parameter (AdamWFp8's compiled step assumed the same; fused steps and the rest: bytes at HBM "
            f"speed); FSDP2 copies {self.fsdp_gather_copy_s_per_elem * 1e12:.2f}"
            f" ps per gathered and {self.fsdp_reduce_copy_s_per_elem * 1e12:.2f} ps per reduced element",
            f"assumed: network: {self.gpus_per_node} GPUs per node, NVLink bus bandwidth {self.nvlink_busbw / g:.0f} "
            f"GB/s, InfiniBand {self.ib_busbw / g:.0f} GB/s per GPU, all-to-all at {self.a2a_efficiency:.0%} of "
            f"those, {self.collective_latency_s * 1e6:.0f} us per collective; host link {self.host_link / g:.0f} GB/s "
            "(offloaded block inputs)",
        ]


# H200 SXM. Sources: measured_h200.md (GEMM 749, FP8 MLP speed-ups 1.59x/1.31x at D=4096, chunk_kda 21.8 ms fwd+bwd
# and 4.34 ms fwd for T=32768 x H=32, d2d ~4 TB/s); docs/performance.md (grouped expert GEMMs 37.0 ms for
# 24.7 TFLOP in the proxy profile = 668 TFLOP/s; cuDNN masked attention backward 27.6 ms for two DSA layers at
# T=4096, 64 heads, d_qk=d_v=256: 2.5 x 2 x 4096^2 x 64 x 512 x 2 FLOP = 5.5 TFLOP -> 199 TFLOP/s; FP32 SIMT dW GEMM
# 53 TFLOP/s; fused CE 39.2 ms per 4096 tokens). total_memory 139.8 GiB as torch reported it there.
H200 = GpuSpec(
    name="H200",
    memory_bytes=139.8 * GIB,
    peak_bf16=989e12,
    gemm_bf16=749e12,
    gemm_grouped_bf16=668e12,
    fp8_speedup_tensorwise=1.59,
    fp8_speedup_rowwise=1.31,
    # The routed experts' FP8 split on an H100 (docs/performance.md, twenty-third session; proxy, reference scope,
    # T = 4,096, 1,024 rows per expert): the grouped GEMM kernels took 38.24 ms in BF16 and 26.75 ms in FP8 (1.43x),
    # yet the step took 17.14 ms longer; the 28.6 ms difference is torchao's casts moving 50.3 GB (timing.py's
    # expert_fp8_cast_bytes) at 1.76 TB/s, 0.52 of the H100's 3.35 TB/s. The cast kernels themselves, profiled on
    # another H100 (twenty-fourth session), sum to 27.91 ms: 0.54. Not measured on the H200: the same kernel
    # speed-up and fraction assumed.
    fp8_speedup_grouped=1.43,
    fp8_cast_efficiency=0.52,
    gemm_fp32=53e12,
    attention_masked=199e12,
    # scripts/bench_dsa.py, one proxy DSA layer's sparse op fwd+bwd: 3.5 x 2 x T x K x 64 heads x 2 x 512 FLOP with
    # K = 2,051: 290.0 ms at T = 32,768 (106 TFLOP/s), 64.4 ms at 8,192 (120), 32.1 ms at 4,096 (120). Before it was
    # timed the planner assumed 270. The transposed-dkv backward (docs/performance.md, ninth session) runs 191.2 ms at
    # 32,768 (161 TFLOP/s). The end-to-end rows in tests/unit/planner_measured_h200.json ran the earlier kernel, and
    # at 161 the 128K eager row would plan 17% fast, so the rate stays at 115 until those rows are measured again.
    attention_sparse=115e12,
    # scripts/bench_dsa.py at T = 32,768 (docs/performance.md, ninth session): causal SDPA over one proxy DSA layer
    # fwd+bwd, 3.5 x 2 x (T^2 / 2) x 64 heads x 512 FLOP = 123.1 TFLOP in 269.3 ms
    attention_causal=457e12,
    kda_fwd_bwd_s_per_token_head=21.8e-3 / (32768 * 32),
    kda_fwd_s_per_token_head=4.34e-3 / (32768 * 32),
    fused_ce_s_per_token=39.2e-3 / 4096,
    hbm_bandwidth=4.0e12,
    gpus_per_node=8,
    nvlink_busbw=360e9,
    ib_busbw=40e9,
    a2a_efficiency=0.8,
    collective_latency_s=30e-6,
    host_link=50e9,  # PCIe Gen5 x16 is 64 GB/s per direction; not measured here
    # Residual of the proxy benchmark (current code) after every modelled term, per token and block (9 blocks with
    # MTP, 8 without): reference scope compiled, no AC: 273.8 ms measured - 203.5 modelled at T=4096 (2.15 us),
    # 596.0 - 486.9 at T=8192 (1.66 us), mean 1.90 us; training scope, selective: 432.3 - 325.9 ms at T=4096
    # (2.89 us); full: selective + (61 - 45.3 ms) / (9 x 4096) from the earlier table's full - selective step
    # difference less the modelled one (3.32 us); eager: compiled + 246 ms / (9 x 4096) (the earlier eager - compiled
    # difference, no AC) (8.57 us); eager under full AC: the training scope's eager full-AC runs (sparse KL, moe
    # chunks 16384, 3 documents) at T = 4K, 32K and 64K (16.1, 14.4, 15.5 us; mean 15.3 us); eager under selective
    # AC is not measured: eager's term plus selective's over compiled's (9.56 us, assumed). docs/performance.md,
    # planner section, lists the figures.
    elementwise_s_per_token_block={"compiled": 1.90e-6, "selective": 2.89e-6, "full": 3.32e-6, "eager": 8.57e-6,
                                   "eager_full": 15.3e-6, "eager_selective": 9.56e-6},
    # train.py on the proxy (7.95e9 trainable elements, FSDP2 on one GPU), profiled steps 12-13 (docs/performance.md,
    # ninth session): torchao AdamW8bit's step spans 185.7 ms of the device's time per step (137.6 ms of kernels,
    # the rest launch gaps); FSDP2's pre-forward and pre-backward casts 20.2 and 23.6 ms (one gather each), its
    # post-backward reduce copies 34.8 ms. The gradient clip (26.1 ms) matches the bytes model (12 B per element).
    # The fused low-bit steps, scripts/bench_optim.py over the same parameters (CUDA events, sixteenth session):
    # AdamW8bit's kernel 98.5 ms (1 block/2 warps, "checked" codes; the default "approx" is 21% faster on an H100,
    # not yet timed on the H200, so the H200 rate stays the one measured),
    # AdamWFp8's step 39.0 ms (31.8 in another call). torchao's AdamWFp8 step took 153.4 ms there against
    # its AdamW8bit's 159.4, so AdamWFp8's compiled step keeps AdamW8bit's train.py rate.
    optimizer_s_per_param={"AdamW8bit compiled": 185.7e-3 / 7.95e9, "AdamW8bit fused": 98.5e-3 / 7.95e9,
                           "AdamWFp8 fused": 39.0e-3 / 7.95e9},
    fsdp_gather_copy_s_per_elem=(20.2e-3 + 23.6e-3) / 2 / 7.95e9,
    fsdp_reduce_copy_s_per_elem=34.8e-3 / 7.95e9,
)

GPUS = {"h200": H200}


def get_gpu(name: str, **overrides: float) -> GpuSpec:
    """A named GPU spec with any field replaced (e.g. ib_busbw=25e9 for a slower fabric)."""
    key = name.lower()
    if key not in GPUS:
        raise ValueError(f"unknown --gpu {name!r}; known: {sorted(GPUS)}")
    return dataclasses.replace(GPUS[key], **overrides)
