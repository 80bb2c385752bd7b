"""torchrun worker (2 ranks) for test_hf_distributed.py: HF checkpoints loaded and exported through DCP's HF storage
under FSDP2, TP and EP, each rank reading and writing only its shards; on 4 ranks, EP 2 with the experts' rows
sharded over the two ranks that hold them (parallelism.expert_fsdp) instead.

usage: _hf_worker.py WORK_DIR
WORK_DIR holds (written by the test) `bf16/` and `fp8/` (save_pretrained of the debug model; fp8: the released FP8
block-scaled layout, several files) and `big/` (a ~110 MB FP32 debug-shaped model in BF16). Per layout, every
parameter after the load equals (bit for bit) hf_io.from_pretrained's single-process model, and the export
reproduces the input files (tensors, dtypes, index, config.json). First, on `big/` under FSDP, the peak resident
memory that the load and the export add (glibc told to return freed blocks at once: MALLOC_MMAP_THRESHOLD_) is
measured against this rank's shard.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from torchtitan_glm.config import ParallelismConfig
from torchtitan_glm.distributed.parallel_dims import ParallelDims
from torchtitan_glm.models.glm5 import Glm5Model, Glm5ModelArgs
from torchtitan_glm.models.glm5.hf_distributed import load_hf_weights_into, save_hf_from_sharded
from torchtitan_glm.models.glm5.hf_io import from_pretrained
from torchtitan_glm.models.glm5.parallelize import parallelize_glm5
from torchtitan_glm.components.errors import exit_now

LAYOUTS = {"fsdp": dict(data_parallel_shard_degree=2),
           "tp": dict(data_parallel_shard_degree=1, tensor_parallel_degree=2),
           "ep": dict(data_parallel_shard_degree=2, expert_parallel_degree=2)}
LAYOUTS_4 = {"ep_expert_fsdp": dict(data_parallel_shard_degree=4, expert_parallel_degree=2, expert_fsdp=True)}


def build(args: Glm5ModelArgs, layout: str) -> torch.nn.Module:
    cfg = ParallelismConfig(**{**LAYOUTS, **LAYOUTS_4}[layout])
    dims = ParallelDims.from_config(cfg, world_size=dist.get_world_size())
    with torch.device("meta"):
        model = Glm5Model(args)
    parallelize_glm5(model, meshes=dims.build_mesh("cpu"), param_dtype="float32", reduce_dtype="float32",
                     ac_mode="none", compile_enable=False, expert_fsdp=cfg.expert_fsdp)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).fill_(float("nan"))  # nothing left from an init
    return model


def same_files(got: Path, want: Path) -> None:
    names = sorted(os.listdir(want))
    assert sorted(os.listdir(got)) == names, (os.listdir(got), names)
    for name in names:
        if not name.endswith(".safetensors"):
            assert json.loads((got / name).read_text()) == json.loads((want / name).read_text()), name
            continue
        a, b = load_file(got / name), load_file(want / name)
        assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:6]
        for k in b:
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, (k, a[k].dtype, b[k].dtype)
            assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), f"{name}: {k} differs"


def rss_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def peak_added_mib(fn) -> float:
    """Peak resident memory (MiB) that fn adds over what this process holds when it starts (VmHWM reset first)."""
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = rss_kib("VmRSS")
    fn()
    return (rss_kib("VmHWM") - start) / 1024


def main() -> None:
    work = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    layouts = LAYOUTS_4 if dist.get_world_size() == 4 else LAYOUTS
    if layouts is LAYOUTS:
        memory_check(work, rank)
    check_layouts(work, rank, layouts)
    dist.destroy_process_group()


def memory_check(work: Path, rank: int) -> None:
    # -- memory: the ~110 MB model under FSDP over 2 ranks (about 55 MB of FP32 parameters each)
    big_args = Glm5ModelArgs.from_hf_config(work / "big")
    model = build(big_args, "fsdp")
    shard_mib = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * 4 for p in model.parameters()) / 2**20
    full_mib = sum(p.numel() * 4 for p in model.parameters()) / 2**20
    load = peak_added_mib(lambda: load_hf_weights_into(model, work / "big"))
    export = peak_added_mib(lambda: save_hf_from_sharded(model, work / "out" / "big", dtype=torch.bfloat16))
    print(f"rank {rank}: full model {full_mib:.0f} MiB FP32, shard {shard_mib:.0f} MiB; load added {load:.1f} MiB, "
          f"export added {export:.1f} MiB", flush=True)
    # The load fills the shard in place: what it adds is the file pages of this rank's slices (memory-mapped, so
    # resident: BF16, half the FP32 shard) and one tensor's slice in flight (measured: ~0.6 x the shard). The export
    # holds a BF16 copy of the shard and its serialised bytes, then one tensor at a time while consolidating
    # (measured: ~1.5 x the shard). Building the whole model on a rank, as before, adds at least the whole FP32 model
    # (2 x the shard) plus the file.
    assert load < 0.75 * shard_mib, f"load added {load:.1f} MiB for a {shard_mib:.0f} MiB shard"
    assert export < 1.75 * shard_mib, f"export added {export:.1f} MiB for a {shard_mib:.0f} MiB shard"
    if rank == 0:
        same_files(work / "out" / "big", work / "big")
    del model


def check_layouts(work: Path, rank: int, layouts: dict) -> None:
    # -- every layout, BF16 and FP8 sources: the load equals from_pretrained's, the export reproduces the files
    for source in ("bf16", "fp8"):
        reference = from_pretrained(work / source)
        ref = dict(list(reference.named_parameters()) + list(reference.named_buffers()))
        for layout in layouts:
            model = build(Glm5ModelArgs.from_hf_config(work / source), layout)
            if layout == "ep_expert_fsdp":  # the experts really are 2-D sharded
                w = next(p for n, p in model.named_parameters() if n.endswith("experts.gate_proj"))
                assert isinstance(w, DTensor) and w.device_mesh.ndim == 2, w
            load_hf_weights_into(model, work / source)
            for name, p in list(model.named_parameters()) + list(model.named_buffers()):
                full = p.full_tensor() if isinstance(p, DTensor) else p
                assert torch.equal(full, ref[name]), f"{layout} {source}: {name} differs after the load"
            out = work / "out" / f"{source}_{layout}"
            save_hf_from_sharded(model, out, dtype=torch.bfloat16, fp8=source == "fp8", max_shard_bytes=200_000)
            if rank == 0:
                same_files(out, work / source)
            try:
                save_hf_from_sharded(model, out, dtype=torch.bfloat16)
                raise AssertionError("an existing export was overwritten")
            except FileExistsError as e:
                assert "not empty" in str(e)
            print(f"rank {rank} {source} {layout} OK", flush=True)


if __name__ == "__main__":
    exit_now(main() or 0)  # no interpreter teardown after the process group is gone (see exit_now)
