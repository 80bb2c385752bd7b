"""The sparse attention backward's machine code per config, on the CPU: registers, spills, shared memory and the
dkv adds as the GPU runs them (no GPU needed: Triton compiles for sm_90 and its bundled ptxas and cuobjdump read
the result). For choosing configs before a GPU session; the timings come from bench_sparse_mla_configs.py.

    python scripts/sparse_mla_sass.py                                  # the kernel's autotuning list
    python scripts/sparse_mla_sass.py --configs "64,32,16,2;32,32,8,2"

A config is BLOCK_H,BLOCK_K,num_warps,num_stages; GLM-5.3-Flash's shapes (K = 2,051, D = 512), pointers and
strides 16-divisible as the GPU specialises them. Prints one JSON line per config; fits_shared is false where
shared_bytes passes the 232,448 bytes (227 KiB) a block may opt into on sm_90 (CUDA C Programming Guide, compute
capability 9.0 table): such a config cannot launch on an H100 or H200.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from cuda_timing import at_least, kernel_configs

SM90_MAX_SHARED_PER_BLOCK = 232_448  # bytes, with the opt-in (cudaFuncAttributeMaxDynamicSharedMemorySize)

# _bwd_kernel's runtime arguments and their Triton types (BF16 tensors, FP32 lse and dkv, int32 sizes and strides)
NAMES = ("Q", "KV", "IDX", "OUT", "DO", "LSE", "DQ", "DKV", "T", "H", "scale", "scale_log2e",
         "sq_b", "sq_t", "sq_h", "so_b", "so_t", "so_h", "sdo_b", "sdo_t", "sdo_h", "sdq_b", "sdq_t", "sdq_h",
         "skv_b", "skv_t", "si_b", "si_t", "sl_b", "sl_t")
TYPES = ("*bf16", "*bf16", "*i32", "*bf16", "*bf16", "*fp32", "*bf16", "*fp32", "i32", "i32", "fp32",
         "fp32") + ("i32",) * 18


def compile_bwd(block_h: int, block_k: int, num_warps: int, num_stages: int, *, k: int = 2051, d: int = 512):
    """ops/sparse_mla_triton.py's backward kernel compiled for sm_90 (Triton's CompiledKernel: .asm, .metadata)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from torchtitan_glm.ops.sparse_mla_triton import _bwd_kernel

    sig = dict(zip(NAMES, TYPES)) | dict.fromkeys(["K", "D", "BLOCK_D", "PRECISION", "BLOCK_H", "BLOCK_K"], "constexpr")
    constexprs = dict(K=k, D=d, BLOCK_D=triton.next_power_of_2(d), PRECISION="tf32", BLOCK_H=block_h, BLOCK_K=block_k)
    divisible = [i for i, n in enumerate(NAMES) if n not in ("H", "scale", "scale_log2e")]
    src = ASTSource(fn=_bwd_kernel, signature=sig, constexprs=constexprs,
                    attrs={(i,): [["tt.divisibility", 16]] for i in divisible})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def ptx_global_adds(ptx: str) -> Counter:
    """FP32 adds to global memory in PTX, by (instruction, width): ("atom" | "red", "v4.f32" | "f32")."""
    return Counter(re.findall(r"\b(atom|red)\.global\.gpu\.relaxed\.add\.(v4\.f32|f32)\b", ptx))


def _ptxas() -> str:
    """The ptxas Triton itself runs for sm_90 (Triton 3.9 uses its newer `ptxas-blackwell` there)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(90).path


def sass_global_adds(cubin: bytes) -> Counter:
    """Adds to global memory in the machine code, by SASS instruction (REDG returns nothing, ATOMG the old value)."""
    cuobjdump = Path(_ptxas()).with_name("cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.cubin").write_bytes(cubin)
        sass = subprocess.run([str(cuobjdump), "-sass", str(Path(tmp) / "k.cubin")], capture_output=True, text=True,
                              check=True).stdout
    return Counter(re.findall(r"\b((?:REDG|ATOMG)\.E\.ADD\S*)", sass))


def ptxas_usage(ptx: str) -> dict:
    """Registers and spill bytes from `ptxas -v` for the PTX's own target."""
    target = next(line.split()[1] for line in ptx.splitlines() if line.startswith(".target"))
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.ptx").write_text(ptx)
        log = subprocess.run([_ptxas(), "-v", f"--gpu-name={target}", str(Path(tmp) / "k.ptx"),
                              "-o", str(Path(tmp) / "k.cubin")], capture_output=True, text=True, check=True).stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return dict(registers=int(re.search(r"Used (\d+) registers", log).group(1)),
                spill_store_bytes=int(spills.group(1)), spill_load_bytes=int(spills.group(2)))


def report(cfg: tuple[int, int, int, int], *, k: int, d: int) -> dict:
    kernel = compile_bwd(*cfg, k=k, d=d)
    ptx = kernel.asm["ptx"]
    shared = kernel.metadata.shared
    return dict(config=list(cfg), **ptxas_usage(ptx), shared_bytes=shared,
                fits_shared=shared <= SM90_MAX_SHARED_PER_BLOCK,
                wgmma=len(re.findall(r"\bwgmma\.mma_async", ptx)),
                ptx_adds={f"{op}.{w}": n for (op, w), n in ptx_global_adds(ptx).items()},
                sass_adds=dict(sass_global_adds(kernel.asm["cubin"])))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", type=kernel_configs, default=None,
                   help="';'-separated BLOCK_H,BLOCK_K,num_warps,num_stages (default: the kernel's autotuning list)")
    p.add_argument("--k", type=at_least(1), default=2051, help="tokens per query")
    p.add_argument("--d", type=at_least(1), default=512, help="latent width")
    a = p.parse_args()
    try:
        import triton  # noqa: F401
    except ImportError:
        print("sparse_mla_sass.py: needs triton (pip install triton); it needs no GPU", file=sys.stderr)
        sys.exit(2)
    from torchtitan_glm.ops.sparse_mla_triton import BWD_CONFIGS

    configs = a.configs or BWD_CONFIGS
    from triton.compiler.errors import CompilationError

    for cfg in configs:
        try:
            print(json.dumps(report(cfg, k=a.k, d=a.d)), flush=True)
        except (CompilationError, subprocess.CalledProcessError, RuntimeError) as e:  # a config Triton or ptxas refuses
            print(json.dumps(dict(config=list(cfg), failed=str(e).strip().splitlines()[-1][:300])), flush=True)


if __name__ == "__main__":
    main()
