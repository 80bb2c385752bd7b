"""scripts/precision_agreement.py runs on the debug flavor on CPU and reports the documented fields; the FP8 split
agrees with BF16 better than everything-FP8 does (the reason the split exists), at least on this tiny model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchtitan_glm.models.glm5.args import FLAVORS, get_flavor

REPO = Path(__file__).resolve().parents[2]


def test_precision_agreement_on_debug(tmp_path):
    out = tmp_path / "agree.json"
    proc = subprocess.run([sys.executable, "scripts/precision_agreement.py", "--flavor", "debug", "--seq-len", "256",
                           "--device", "cpu", "--json", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    for name in ("fp32", "fp8_split", "fp8_all"):
        assert set(r[name]) == {"pearson", "top1_agreement", "mean_kl", "indexer_topk_overlap"}
        assert 0.9 < r[name]["pearson"] < 1.0 and len(r[name]["indexer_topk_overlap"]) == 1
    assert r["fp8_split"]["mean_kl"] < r["fp8_all"]["mean_kl"]
    assert r["fp8_split"]["indexer_topk_overlap"][0] > r["fp8_all"]["indexer_topk_overlap"][0]
    assert "fp8_split" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_no_cuda_and_no_device_is_refused_quickly():
    # Without CUDA the default would be the proxy on CPU for many minutes: the script asks for --device instead.
    proc = subprocess.run([sys.executable, "scripts/precision_agreement.py"], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"})
    assert proc.returncode == 2 and "--device cpu" in proc.stderr, proc.stderr[-2000:]


KPOOL = get_flavor("debug").index_kpool


@pytest.mark.parametrize("args,named", [
    (("--flavor", "nope"), ["--flavor", "'nope'", *FLAVORS]),
    # the indexer selects whole pools of index_kpool tokens: one token fewer left its overlap "nan%"
    (("--flavor", "debug", "--seq-len", str(KPOOL - 1)), ["--seq-len", f">= {KPOOL}", f"index_kpool = {KPOOL}"]),
])
def test_bad_flavor_or_too_short_row_exits_2_in_one_line(args, named):
    proc = subprocess.run([sys.executable, "scripts/precision_agreement.py", *args, "--device", "cpu"], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"})
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(errors) == 1, proc.stderr[-2000:]
    assert all(n in errors[0] for n in named), errors
