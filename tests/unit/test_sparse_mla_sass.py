"""The sparse attention backward's dkv adds, as the GPU runs them: compiled for sm_90 on the CPU by
scripts/sparse_mla_sass.py (Triton's front end and its bundled ptxas and cuobjdump need no GPU). Triton 3.6 writes the
unread `tl.atomic_add` as PTX `atom` (which returns the old values; Triton 3.9 writes `red`), and ptxas turns it into
a `REDG` reduction, which returns nothing. The check guards that: a kernel change that read the adds' results, or a
toolchain that kept `ATOMG`, would add return traffic of the adds' own size (137.6 GB per layer backward at
T = 32,768; docs/performance.md, "Twenty-sixth session")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.script_loader import load_script

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]


def test_dkv_adds_compile_to_vector_reductions_on_sm90(monkeypatch):
    """The backward at GLM-5.3-Flash's shapes (K = 2,051, D = 512) in the kernel's first config: every global FP32
    add in its SASS is a 4-wide REDG, one per PTX add."""
    from torchtitan_glm.ops.sparse_mla_triton import BWD_CONFIGS

    sass = load_script("sparse_mla_sass", monkeypatch)
    kernel = sass.compile_bwd(*BWD_CONFIGS[0])
    ptx_adds = sass.ptx_global_adds(kernel.asm["ptx"])
    # 4-wide adds: Triton 3.6 writes them as atom, Triton >= 3.9 as red (triton-lang/triton PR #10724)
    assert sum(ptx_adds.values()) > 0 and all(width == "v4.f32" for _, width in ptx_adds), ptx_adds
    global_adds = sass.sass_global_adds(kernel.asm["cubin"])
    assert global_adds and all(op.startswith("REDG.E.ADD.F32x4") for op in global_adds), global_adds
    assert sum(global_adds.values()) == sum(ptx_adds.values())  # one reduction per PTX add, none returns a value


def test_script_reports_a_config_and_refuses_a_malformed_one():
    cmd = [sys.executable, str(REPO / "scripts" / "sparse_mla_sass.py")]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd + ["--configs", "64,16"], capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "argument --configs" in proc.stderr and "'64,16'" in proc.stderr, proc.stderr
    proc = subprocess.run(cmd + ["--configs", "32,16,8,1;64,32,16,2", "--k", "64"], capture_output=True, text=True,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    small, big = (json.loads(line) for line in proc.stdout.splitlines()[-2:])
    assert small["config"] == [32, 16, 8, 1] and small["registers"] > 0 and small["shared_bytes"] > 0
    assert set(small["sass_adds"]) == {"REDG.E.ADD.F32x4.FTZ.RN.STRONG.GPU"}
    # 64 heads x 32 tokens x 2 stages of the 512-wide latent need more shared memory than an sm_90 block may have
    assert small["fits_shared"] and small["shared_bytes"] <= 232_448
    assert big["config"] == [64, 32, 16, 2] and not big["fits_shared"] and big["shared_bytes"] > 232_448
