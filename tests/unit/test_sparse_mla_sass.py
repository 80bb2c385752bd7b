"""The sparse attention backward's dkv adds, as the GPU runs them: compiled for sm_90 on the CPU (Triton's front end
and its bundled ptxas and cuobjdump need no GPU). Triton 3.6 writes the unread `tl.atomic_add` as PTX `atom` (which
returns the old values); ptxas turns it into a `REDG` reduction, which returns nothing (Triton 3.9 writes `red`). The check guards that: a
kernel change that read the adds' results, or a toolchain that kept `ATOMG`, would add return traffic of the adds'
own size (137.6 GB per layer backward at T = 32,768; docs/performance.md, "Twenty-sixth session")."""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

NAMES = ["Q", "KV", "IDX", "OUT", "DO", "LSE", "DQ", "DKV", "T", "H", "scale", "scale_log2e",
         "sq_b", "sq_t", "sq_h", "so_b", "so_t", "so_h", "sdo_b", "sdo_t", "sdo_h", "sdq_b", "sdq_t", "sdq_h",
         "skv_b", "skv_t", "si_b", "si_t", "sl_b", "sl_t"]
TYPES = ["*bf16", "*bf16", "*i32", "*bf16", "*bf16", "*fp32", "*bf16", "*fp32", "i32", "i32", "fp32", "fp32"] + ["i32"] * 18


def test_dkv_adds_compile_to_vector_reductions_on_sm90(tmp_path):
    """The backward at GLM-5.3-Flash's shapes (K = 2,051, D = 512) in the kernel's first config, with pointers and
    strides 16-divisible as the GPU specialises them: every global FP32 add in its SASS is a 4-wide REDG."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from torchtitan_glm.ops.sparse_mla_triton import _BWD_CONFIGS, _bwd_kernel

    cfg = _BWD_CONFIGS[0]
    sig = dict(zip(NAMES, TYPES)) | dict.fromkeys(["K", "D", "BLOCK_D", "PRECISION", "BLOCK_H", "BLOCK_K"], "constexpr")
    constexprs = dict(K=2051, D=512, BLOCK_D=512, PRECISION="tf32", **cfg.kwargs)
    divisible = [i for i, n in enumerate(NAMES) if n not in ("H", "scale", "scale_log2e")]
    src = ASTSource(fn=_bwd_kernel, signature=sig, constexprs=constexprs,
                    attrs={(i,): [["tt.divisibility", 16]] for i in divisible})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    ptx_adds = Counter(re.findall(r"\b(atom|red)\.global\.gpu\.relaxed\.add\.(v4\.f32|f32)\b", kernel.asm["ptx"]))
    # 4-wide adds: Triton 3.6 writes them as atom, Triton >= 3.9 as red (triton-lang/triton PR #10724)
    assert sum(ptx_adds.values()) > 0 and all(width == "v4.f32" for _, width in ptx_adds), ptx_adds

    cuobjdump = Path(triton.knobs.nvidia.ptxas.path).with_name("cuobjdump")
    if not cuobjdump.exists():
        pytest.skip(f"no cuobjdump beside Triton's ptxas ({cuobjdump})")
    (tmp_path / "bwd.cubin").write_bytes(kernel.asm["cubin"])
    sass = subprocess.run([str(cuobjdump), "-sass", str(tmp_path / "bwd.cubin")], capture_output=True, text=True,
                          check=True).stdout
    global_adds = Counter(re.findall(r"\b((?:REDG|ATOMG)\.E\.ADD\S*)", sass))
    assert global_adds and all(op.startswith("REDG.E.ADD.F32x4") for op in global_adds), global_adds
    assert sum(global_adds.values()) == sum(ptx_adds.values())  # one reduction per PTX add, none returns a value
