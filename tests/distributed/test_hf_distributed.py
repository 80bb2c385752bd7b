"""HF checkpoints at full scale: load and export through torch DCP's HF storage with the state-dict adapter, each
rank reading and writing only its shards (models/glm5/hf_distributed.py). Under FSDP2, TP and EP on 2 gloo ranks
(_hf_worker.py) and in one process: the load equals hf_io.from_pretrained bit for bit, load -> export reproduces
the input files (BF16 and the released FP8 block-scaled layout, several files), and the memory a rank adds stays
near its shard (measured on a ~110 MB model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from torchtitan_glm.models.glm5 import Glm5Model, get_flavor, save_pretrained
from torchtitan_glm.models.glm5.hf_distributed import load_hf_weights_into, save_hf_from_sharded
from torchtitan_glm.models.glm5.hf_io import from_pretrained

from .test_train import _free_port

ROOT = Path(__file__).resolve().parents[2]


def _write_sources(work: Path, *, big: bool) -> None:
    torch.manual_seed(0)
    model = Glm5Model(get_flavor("debug"))
    save_pretrained(model, work / "bf16", dtype=torch.bfloat16, max_shard_bytes=200_000)
    save_pretrained(model, work / "fp8", dtype=torch.bfloat16, fp8=True, max_shard_bytes=200_000)
    if big:  # ~27 M parameters, most of them in 96 expert matrices of 1 MB
        save_pretrained(Glm5Model(get_flavor("debug").replace(moe_intermediate_size=4096)), work / "big",
                        dtype=torch.bfloat16)


def _same_files(got: Path, want: Path) -> None:
    assert sorted(os.listdir(got)) == sorted(os.listdir(want))
    for name in os.listdir(want):
        if not name.endswith(".safetensors"):
            assert json.loads((got / name).read_text()) == json.loads((want / name).read_text()), name
            continue
        a, b = load_file(got / name), load_file(want / name)
        assert a.keys() == b.keys()
        for k in b:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


def _hf_worker(work: Path, nproc: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={_free_port()}",
           str(Path(__file__).with_name("_hf_worker.py")), str(work)]
    env = dict(os.environ, TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return res


def test_fsdp_tp_ep_load_and_export_read_and_write_only_their_shards(tmp_path):
    _write_sources(tmp_path, big=True)
    res = _hf_worker(tmp_path, 2)
    for rank in range(2):
        for source in ("bf16", "fp8"):
            for layout in ("fsdp", "tp", "ep"):
                assert f"rank {rank} {source} {layout} OK" in res.stdout


@pytest.mark.long
def test_expert_fsdp_load_and_export(tmp_path):
    """4 ranks, ep 2, each expert's rows split over the two ranks that hold it (parallelism.expert_fsdp, a 2-D
    DTensor): the HF load equals from_pretrained's and the export reproduces the BF16 and FP8 files."""
    _write_sources(tmp_path, big=False)
    res = _hf_worker(tmp_path, 4)
    for rank in range(4):
        for source in ("bf16", "fp8"):
            assert f"rank {rank} {source} ep_expert_fsdp OK" in res.stdout


@pytest.mark.parametrize("source", ["bf16", "fp8"])
def test_one_process_load_and_export(tmp_path, source):
    _write_sources(tmp_path, big=False)
    reference = from_pretrained(tmp_path / source)
    model = Glm5Model(reference.args)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    load_hf_weights_into(model, tmp_path / source)
    want = dict(reference.state_dict())
    for name, t in model.state_dict().items():
        assert torch.equal(t, want[name]), name
    save_hf_from_sharded(model, tmp_path / "out", dtype=torch.bfloat16, fp8=source == "fp8", max_shard_bytes=200_000)
    _same_files(tmp_path / "out", tmp_path / source)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp")]  # published atomically
    with pytest.raises(FileExistsError, match="not empty"):
        save_hf_from_sharded(model, tmp_path / "out")


def test_single_file_export_has_no_index_and_a_stray_file_is_refused(tmp_path):
    torch.manual_seed(0)
    model = Glm5Model(get_flavor("debug"))
    save_hf_from_sharded(model, tmp_path / "one", dtype=torch.float32)
    assert sorted(os.listdir(tmp_path / "one")) == ["config.json", "model.safetensors"]
    loaded = from_pretrained(tmp_path / "one")
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    save_pretrained(model, tmp_path / "sharded", max_shard_bytes=200_000)
    (tmp_path / "sharded" / "extra.safetensors").write_bytes((tmp_path / "one" / "model.safetensors").read_bytes())
    with pytest.raises(OSError, match=r"extra\.safetensors"):
        load_hf_weights_into(Glm5Model(get_flavor("debug")), tmp_path / "sharded")
