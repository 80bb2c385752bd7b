"""HF checkpoints for a parallelized Glm5Model (any FSDP2/TP/EP layout, or none) through torch DCP's HF storage:
the trainer's initial load and final export. No rank ever holds more than its own shards (plus one tensor while
consolidating an output file), so it scales to the 320.8 B model.

Load: the HF names are mapped onto the model's own (sharded) tensors by the state-dict adapter -- DTensors for
ordinary parameters, plain per-expert views of this rank's slice of the stacked [E, out, in] experts -- and
`dcp.load` with a HuggingFaceStorageReader reads into them in place: each rank reads only its slice of each tensor
(safetensors slices of the memory-mapped files); FP8 block-scaled weights are dequantised per slice with the scale
tiles covering it (bit-identical to the whole-tensor dequantisation of hf_io.from_pretrained).

Export: each rank casts (or FP8-quantises, with tile amaxes combined by one all-reduce MAX) its own shards and
writes them with HuggingFaceStorageWriter(save_distributed=True); the ranks then consolidate the shard files into the
released layout (torch's consolidate_safetensors_files_on_every_rank: each output file assembled by one rank, one
tensor at a time) and rank 0 writes config.json and publishes the folder atomically. The files, names, dtypes, FP8
layout, sharding into 5 GB files and config.json are those of hf_io.save_pretrained.

Pinned behaviour: the reader overrides HuggingFaceStorageReader.read_metadata and _process_read_request (identical
in torch 2.11 and 2.13; tests/distributed/test_hf_distributed.py exercises both paths).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import uuid
import warnings
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank
from torch.distributed.checkpoint._hf_utils import _gen_file_name, _HFStorageInfo, _metadata_fn
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from torchtitan_glm.config import SERVING_BF16_ROLES
from torchtitan_glm.float8 import plain_tensors

from .hf_io import (
    CONFIG_NAME, DEFAULT_MAX_SHARD_BYTES, INDEX_FILE, SINGLE_FILE, _checkpoint_files, _export_config,
    _fp8_export_names, _fp32_hf_names, _indexer_hf_modules, _plan_shards, _publish, _quantization_config, _read_json,
    _open_files, _scan, check_extra_files, check_keep_bf16, fp8_quantization_config, write_extra_files,
)
from .model import Glm5Model
from .state_dict_adapter import (
    LM_HEAD, SCALE_SUFFIX, CheckpointMismatchError, Glm5StateDictAdapter, dequantize_fp8_block_region,
    fp8_block_amax_region, fp8_scale_inv, fp8_scale_shape, quantize_fp8_block_region,
)

logger = logging.getLogger(__name__)

__all__ = ["load_hf_weights_into", "save_hf_from_sharded"]


def _unwrap(model: nn.Module) -> Glm5Model:
    return getattr(model, "_orig_mod", model)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _local(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's part of `t` (a DTensor's local shard, or the whole plain tensor) and its offset in the whole."""
    if isinstance(t, DTensor):
        _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return t.to_local(), tuple(int(o) for o in offset)
    return t, (0,) * t.ndim


def _local_experts(name: str, t: torch.Tensor) -> list[tuple[int, torch.Tensor | None, torch.Tensor, int]]:
    """This rank's part of each of its stacked experts [E, out, in], as (expert index, DTensor of the per-expert
    [out, in] tensor or None when the rank holds it whole, local rows, first row). FSDP2 and expert parallelism split
    dim 0 (whole experts); parallelism.expert_fsdp also splits dim 1 evenly over one mesh dim (`Shard(1)`), so each
    per-expert tensor is then row-sharded over that dim's ranks."""
    local, offset = _local(t)
    rows_split = tuple(local.shape[1:]) != tuple(t.shape[1:])
    dims = [i for i, p in enumerate(getattr(t, "placements", ())) if p.is_shard(1)]
    if offset[2] != 0 or local.shape[2] != t.shape[2] or (rows_split and len(dims) != 1):
        raise RuntimeError(f"{name}: its shard {tuple(local.shape)} at {offset} is neither a set of whole experts of "
                           f"{tuple(t.shape)} nor their rows split over one mesh dim")
    if not rows_split:
        return [(offset[0] + i, None, local[i], 0) for i in range(local.shape[0])]
    mesh = t.device_mesh[t.device_mesh.mesh_dim_names[dims[0]]]
    return [(offset[0] + i, DTensor.from_local(local[i], mesh, [Shard(0)], run_check=False), local[i], offset[1])
            for i in range(local.shape[0])]


def _model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors by our state-dict names (compile/AC prefixes removed), sharing their storage."""
    return plain_tensors(get_model_state_dict(model))


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes a single process when there is no process group: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _shared(value: Any, group: dist.ProcessGroup | None) -> Any:
    box = [value]
    if _distributed():
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]


# ------------------------------------------------------------------------------------------------------ load
class _ShardReader(HuggingFaceStorageReader):
    """HuggingFaceStorageReader over the files of the checkpoint's index (headers scanned once, every safetensors
    dtype, FP8 scales included), dequantising FP8 block-scaled weights per requested slice."""

    def __init__(self, path: str, *, meta: dict[str, tuple], where: dict[str, Path], pairs: dict[str, str],
                 block: tuple[int, int]) -> None:
        super().__init__(path)
        self._meta, self._where, self._pairs, self._block = meta, where, pairs, block

    def read_metadata(self) -> Metadata:
        sd_meta, storage = {}, {}
        for name, (dtype, shape) in self._meta.items():
            size, origin = torch.Size(shape), torch.Size([0] * len(shape))
            sd_meta[name] = TensorStorageMetadata(properties=TensorProperties(dtype=dtype or torch.float32),
                                                  size=size, chunks=[ChunkStorageMetadata(offsets=origin, sizes=size)])
            storage[MetadataIndex(fqn=name, offset=origin)] = _HFStorageInfo(
                relative_path=str(self._where[name]), shape=size, dtype=dtype)
        metadata = Metadata(state_dict_metadata=sd_meta, storage_data=storage)
        metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _process_read_request(self, f: Any, req: Any, planner: Any) -> None:
        name = req.storage_index.fqn
        scale = self._pairs.get(name)
        if scale is None:
            return super()._process_read_request(f, req, planner)
        (r0, c0), (nr, nc) = req.storage_offsets, req.lengths
        bo, bi = self._block
        weight = f.get_slice(name)[r0:r0 + nr, c0:c0 + nc]
        tiles = (slice(r0 // bo, -(-(r0 + nr) // bo)), slice(c0 // bi, -(-(c0 + nc) // bi)))
        if self._where[scale] == self._where[name]:
            scale_inv = f.get_slice(scale)[tiles]
        else:
            from safetensors import safe_open

            with safe_open(str(self._where[scale]), framework="pt") as g:
                scale_inv = g.get_slice(scale)[tiles]
        value = dequantize_fp8_block_region(weight, scale_inv, row0=r0, col0=c0, block=self._block)
        target = planner.resolve_tensor(req).detach()
        if target.size() != value.size():
            raise RuntimeError(f"{name}: read {tuple(value.shape)} for a target of {tuple(target.shape)}")
        target.copy_(value)
        planner.commit_tensor(req, target)
        return None


def load_hf_weights_into(model: nn.Module, hf_dir: str | os.PathLike, *,
                         process_group: dist.ProcessGroup | None = None) -> None:
    """Read an HF checkpoint (config.json + safetensors, sharded or not, FP8 block-scaled or not) into `model` in
    place, each rank only its own shards. Names and shapes are checked against the model's args first
    (CheckpointMismatchError naming the tensors and files); a checkpoint without the MTP layer leaves the model's
    MTP as initialised (a warning); a tied LM head without a stored head is copied from the embedding."""
    hf_dir = Path(hf_dir)
    args = _unwrap(model).args
    adapter = Glm5StateDictAdapter(args)
    quant = _quantization_config(_read_json(hf_dir / CONFIG_NAME))
    block = tuple(quant.get("weight_block_size") or (128, 128))
    files, weight_map = _checkpoint_files(hf_dir)
    stray = sorted(p.name for p in hf_dir.glob("*.safetensors") if p not in set(files))
    if stray:
        raise OSError(f"{hf_dir} holds safetensors files its index does not list: {stray}; move them away")
    with ExitStack() as stack:
        handles = _open_files(stack, files)
        where, meta = _scan(handles, weight_map)
    pairs = adapter.split_fp8_scales(meta, block=block,
                                     modules_to_not_convert=quant.get("modules_to_not_convert") or ())
    scales = set(pairs.values())
    report = adapter.check_hf({k: s for k, (_, s) in meta.items() if k not in scales}, allow_missing_mtp=True,
                              where={k: p.name for k, p in where.items()})

    state = _model_state(model)
    targets: dict[str, torch.Tensor] = {}
    for ours, t in state.items():
        if ours.startswith("mtp.") and report.missing_mtp:
            continue
        hf = adapter.internal_to_hf(ours)
        if isinstance(hf, list):  # the per-expert HF tensors (DCP loads a row-sharded one's region in place)
            targets.update((hf[e], local if piece is None else piece) for e, piece, local, _ in _local_experts(ours, t))
        elif hf in meta:
            targets[hf] = t
        elif not (hf == LM_HEAD and args.tie_word_embeddings):  # unreachable once check_hf passed
            raise CheckpointMismatchError(f"{hf} (our {ours}) is not in {hf_dir}", missing=[hf])
    reader = _ShardReader(str(hf_dir), meta=meta, where=where, pairs=pairs, block=block)
    with _single_process_quiet():
        dcp.load(targets, storage_reader=reader, process_group=process_group, no_dist=not _distributed())
    if args.tie_word_embeddings and LM_HEAD not in meta:
        with torch.no_grad():
            state["lm_head.weight"].copy_(state["embed_tokens.weight"])
    if report.missing_mtp:
        logger.warning("%s has no MTP layer (layers.%d.*): the MTP module keeps its initialisation", hf_dir,
                       args.num_hidden_layers)
    if pairs:
        logger.info("dequantised %d FP8 block-scaled tensors from %s (each rank its own slices)", len(pairs), hf_dir)


# ---------------------------------------------------------------------------------------------------- export
def _fp8_scales(parts: dict[str, tuple[torch.Tensor | None, torch.Tensor, tuple[int, ...]]],
                shapes: dict[str, tuple[int, ...]], names: list[str],
                group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
    """scale_inv of every FP8-exported weight: each rank's tile amaxes of its parts, combined by one all-reduce MAX
    (tiles may straddle shards; a tile's max does not depend on how it is split)."""
    grids = []
    for name in names:
        grid = torch.zeros(fp8_scale_shape(shapes[name]), dtype=torch.float32)
        if name in parts:
            _, local, offset = parts[name]
            grid = fp8_block_amax_region(local, row0=offset[0], col0=offset[1], full_shape=shapes[name]).cpu()
        grids.append(grid)
    if not grids:
        return {}
    flat = torch.cat([g.reshape(-1) for g in grids])
    if _distributed():
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    out, at = {}, 0
    for name, grid in zip(names, grids):
        out[name] = fp8_scale_inv(flat[at:at + grid.numel()].view_as(grid))
        at += grid.numel()
    return out


def _like(source: torch.Tensor | None, local: torch.Tensor) -> torch.Tensor:
    """`local` in place of source's local shard (a DTensor with source's mesh and placements), or plain."""
    if isinstance(source, DTensor):
        return DTensor.from_local(local, source.device_mesh, source.placements, run_check=False,
                                  shape=source.shape, stride=source.stride())
    return local


def save_hf_from_sharded(model: nn.Module, out_dir: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16,
                         fp8: bool = False, keep_bf16: tuple[str, ...] | list[str] = SERVING_BF16_ROLES,
                         max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                         process_group: dist.ProcessGroup | None = None,
                         extra_files: Mapping[str, bytes] | None = None) -> Path:
    """Write the model as an HF checkpoint in the released layout, every rank its own shards (collective): floating
    tensors in `dtype` except those of keep_fp32 modules (FP32); with fp8 the Linears the FP8 split converts (with
    `keep_bf16`) and the routed experts as E4M3 with 128x128 block scale_inv, and config.json's quantization_config.
    The folder appears complete or not at all; an existing non-empty out_dir is refused (FileExistsError).
    process_group: a gloo group when the default one is NCCL (the FP8 scale exchange runs on CPU). extra_files: more
    files of the folder by name (the tokenizer's), written by rank 0 before the folder is published."""
    check_extra_files(extra_files)
    check_keep_bf16(keep_bf16)
    m = _unwrap(model)
    args = m.args
    adapter = Glm5StateDictAdapter(args)
    out_dir = Path(out_dir)
    rank = dist.get_rank() if _distributed() else 0
    problem, tmp = None, None
    if rank == 0:
        if out_dir.exists() and not out_dir.is_dir():
            problem = f"{out_dir} exists and is not a directory"
        elif out_dir.is_dir() and any(out_dir.iterdir()):
            problem = f"{out_dir} is not empty; not overwriting it with the HF export (move it away)"
        else:
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
    problem, tmp = _shared((problem, tmp), process_group)
    if problem:
        raise FileExistsError(problem)
    try:
        shards = _write_shards(model, m, adapter, tmp, dtype=dtype, fp8=fp8, keep_bf16=keep_bf16,
                               max_shard_bytes=max_shard_bytes, group=process_group)
        if rank == 0:
            _finish(m, adapter, tmp, out_dir, shards, dtype=dtype, extra_files=extra_files)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if _distributed():
        dist.barrier(group=process_group)
    return out_dir


def _write_shards(model: nn.Module, m: Glm5Model, adapter: Glm5StateDictAdapter, tmp: Path, *, dtype: torch.dtype,
                  fp8: bool, keep_bf16: Any, max_shard_bytes: int,
                  group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Every rank writes its shards (DCP) and consolidates its share of the output files; returns the plan."""
    args = m.args
    include_mtp = m.mtp is not None
    shapes = adapter.expected_hf_shapes()
    if not include_mtp:
        mtp_prefix = f"model.language_model.layers.{args.num_hidden_layers}."
        shapes = {n: s for n, s in shapes.items() if not n.startswith(mtp_prefix)}
    with torch.device("meta"):
        ref = Glm5Model(args)  # module types and roles only: which tensors stay FP32, which export in FP8
    fp32 = _fp32_hf_names(ref, adapter)
    quantized = _fp8_export_names(ref, adapter, keep_bf16) & set(shapes) if fp8 else set()

    # This rank's part of every HF tensor: (DTensor it comes from or None, local tensor, offset in the whole).
    parts: dict[str, tuple[torch.Tensor | None, torch.Tensor, tuple[int, ...]]] = {}
    for ours, t in _model_state(model).items():
        if ours.startswith("mtp.") and not include_mtp:
            continue
        hf = adapter.internal_to_hf(ours)
        if isinstance(hf, list):
            parts.update((hf[e], (piece, local, (row, 0))) for e, piece, local, row in _local_experts(ours, t))
        else:
            local, offset = _local(t)
            parts[hf] = (t if isinstance(t, DTensor) else None, local, offset)
    unknown = set(parts) - set(shapes)
    if unknown:
        raise RuntimeError(f"state dict adapter and model disagree: {sorted(unknown)[:8]}")

    dtypes = {n: torch.float8_e4m3fn if n in quantized else torch.float32 if n in fp32 else dtype for n in shapes}
    scale_inv = _fp8_scales(parts, shapes, sorted(quantized), group)
    to_write: dict[str, torch.Tensor] = {}
    for name, (source, local, offset) in parts.items():
        if name in quantized:
            q = quantize_fp8_block_region(local, scale_inv[name], row0=offset[0], col0=offset[1])
            to_write[name] = _like(source, q)
            to_write[name + SCALE_SUFFIX] = scale_inv[name]  # the same on every rank: written once
        else:  # a copy: safetensors refuses tensors sharing storage (the per-expert views)
            to_write[name] = _like(source, local.detach().to(dtypes[name], copy=True))

    names = sorted(shapes)
    sizes = {n: torch.Size(shapes[n]).numel() * dtypes[n].itemsize
             + (4 * torch.Size(fp8_scale_shape(shapes[n])).numel() if n in quantized else 0) for n in names}
    files = _plan_shards(sizes, max_shard_bytes)
    mapping = {n: i + 1 for i, shard in enumerate(files) for n in shard}
    mapping.update({n + SCALE_SUFFIX: mapping[n] for n in quantized})
    sharded = tmp / "sharded"
    writer = HuggingFaceStorageWriter(path=str(sharded), save_distributed=True, fqn_to_index_mapping=mapping,
                                      enable_consolidation=False)
    with _single_process_quiet():
        dcp.save(to_write, storage_writer=writer, process_group=group, no_dist=not _distributed())
    del to_write
    consolidate_safetensors_files_on_every_rank(input_dir=str(sharded), output_dir=str(tmp),
                                                fqn_to_index_mapping=mapping, num_threads=1, process_group=group)
    return {"files": len(files), "mapping": mapping, "total_size": sum(sizes.values()), "shapes": shapes,
            "quantized": quantized, "indexers": _indexer_hf_modules(ref, adapter)}


def _finish(m: Glm5Model, adapter: Glm5StateDictAdapter, tmp: Path, out_dir: Path, plan: dict[str, Any], *,
            dtype: torch.dtype, extra_files: Mapping[str, bytes] | None) -> None:
    """Rank 0: drop the shard files, name a single file as save_pretrained does, write config.json and the extra
    files, publish."""
    shutil.rmtree(tmp / "sharded")
    if os.path.exists(tmp / _metadata_fn):  # torch writes it only when distributed: ours, the same either way
        os.remove(tmp / _metadata_fn)
    if plan["files"] == 1:
        os.rename(tmp / _gen_file_name(1, 1), tmp / SINGLE_FILE)
    else:
        index = {"metadata": {"total_size": plan["total_size"]},
                 "weight_map": {n: _gen_file_name(i, plan["files"]) for n, i in sorted(plan["mapping"].items())}}
        with open(tmp / INDEX_FILE, "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    cfg = _export_config(m, None, dtype)
    if plan["quantized"]:
        cfg["quantization_config"] = fp8_quantization_config(plan["shapes"], plan["quantized"], plan["indexers"])
    with open(tmp / CONFIG_NAME, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    write_extra_files(tmp, extra_files)
    _publish(tmp, out_dir)
    logger.info("exported %d tensors in %d file(s) to %s", len(plan["shapes"]), plan["files"], out_dir)
