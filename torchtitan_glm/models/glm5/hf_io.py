"""HF checkpoint I/O for Glm5Model: `from_pretrained` (safetensors, sharded or not, FP8 block-scaled) and an atomic
`save_pretrained` whose output transformers' glm5_next reads. Single process, full (non-sharded) tensors."""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchtitan_glm.config import FLOAT8_ROLES, SERVING_BF16_ROLES

from .args import TRAINER_FIELDS, Glm5ModelArgs
from .model import Glm5Model
from .state_dict_adapter import (
    LM_HEAD,
    CheckpointMismatchError,
    SCALE_SUFFIX,
    Glm5StateDictAdapter,
    dequantize_fp8_blockwise,
    fp8_scale_shape,
    quantize_fp8_blockwise,
)

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' "5GB"
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}

__all__ = ["CheckpointMismatchError", "HfOrigin", "dequantize_fp8_blockwise", "from_pretrained", "save_pretrained"]


@dataclass
class HfOrigin:
    """Where a model loaded by from_pretrained came from, so save_pretrained can reproduce the files."""

    path: str
    config: dict[str, Any]  # config.json as read
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # file dtype per HF name (FP8 ones excluded)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # ignored tensors kept for export (vision, ...)
    missing_mtp: bool = False  # the files had no MTP layer; the model's MTP is freshly initialised
    quantized: bool = False  # FP8 tensors were dequantised on load


# ---------------------------------------------------------------------- reading
def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise OSError(f"cannot read {path}: {e}") from e


def _quantization_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    q = cfg.get("quantization_config")
    if q is None and isinstance(cfg.get("text_config"), Mapping):
        q = cfg["text_config"].get("quantization_config")
    return dict(q or {})


def _checkpoint_files(hf_dir: Path) -> tuple[list[Path], dict[str, str]]:
    """Safetensors files of the checkpoint and, for a sharded one, the index's name -> file map."""
    index = hf_dir / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise OSError(f"{index} has no weight_map")
        files = sorted({hf_dir / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise OSError(f"{index} lists {f.name}, which does not exist")
        return files, dict(weight_map)
    single = hf_dir / SINGLE_FILE
    if single.is_file():
        return [single], {}
    found = sorted(p.name for p in hf_dir.iterdir()) if hf_dir.is_dir() else []
    raise OSError(f"no {SINGLE_FILE} or {INDEX_FILE} in {hf_dir} (found: {found})")


def _open_files(stack: ExitStack, files: list[Path]) -> dict[Path, Any]:
    """path -> open safetensors handle (closed with `stack`); a corrupt header is an OSError naming the file."""
    from safetensors import safe_open

    handles = {}
    for path in files:
        try:
            handles[path] = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise OSError(f"cannot open {path}: {e}") from e
    return handles


def _scan(handles: Mapping[Path, Any], weight_map: Mapping[str, str]) -> tuple[dict[str, Path], dict[str, tuple]]:
    """name -> file and name -> (dtype, shape) from the headers only; index and files must agree."""
    where: dict[str, Path] = {}
    meta: dict[str, tuple] = {}
    for path, f in handles.items():
        for name in f.keys():
            if name in where:
                raise CheckpointMismatchError(f"tensor {name} is stored twice: in {where[name].name} and {path.name}")
            if weight_map and weight_map.get(name) != path.name:
                raise CheckpointMismatchError(
                    f"tensor {name} is in {path.name} but the index maps it to {weight_map.get(name)}",
                    unexpected=[name])
            sl = f.get_slice(name)
            where[name] = path
            meta[name] = (_ST_DTYPES.get(sl.get_dtype()), tuple(sl.get_shape()))
    absent = set(weight_map) - set(where)
    if absent:
        raise CheckpointMismatchError(f"tensors listed in {INDEX_FILE} but absent from their files: "
                                      f"{sorted(absent)[:12]}", missing=absent)
    return where, meta


def _cast_for_load(model: nn.Module, dtype: torch.dtype) -> None:
    """Floating parameters/buffers to `dtype`, except those of `keep_fp32` modules, which become FP32 (on meta)."""
    for module in model.modules():
        target = torch.float32 if getattr(type(module), "keep_fp32", False) else dtype
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_floating_point() and p.dtype != target:
                setattr(module, name, nn.Parameter(p.detach().to(target), requires_grad=p.requires_grad))
        for name, b in list(module.named_buffers(recurse=False)):
            if b is not None and b.is_floating_point() and b.dtype != target:
                module._buffers[name] = b.to(target)


def from_pretrained(
    hf_dir: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    allow_missing_mtp: bool = True,
    keep_extra_tensors: bool = True,
    overrides: Mapping[str, Any] | None = None,
) -> Glm5Model:
    """Build a Glm5Model from an HF checkpoint directory (config.json + safetensors, sharded or not).

    Every checkpoint tensor is checked by name and shape before any is read (CheckpointMismatchError names the
    offenders and their files); FP8 weights with `weight_scale_inv` are dequantised. Parameters of `keep_fp32`
    modules stay FP32 whatever `dtype`. A checkpoint without the MTP layer (transformers drops it) is accepted with a
    warning when allow_missing_mtp; the MTP then keeps a fresh init. Ignored tensors (vision tower, MTP copies of
    embedding/head) are kept on CPU in `model.hf_origin.extra` when keep_extra_tensors, for save_pretrained.
    `overrides` are trainer-side Glm5ModelArgs fields (e.g. dsa_attention).
    """
    hf_dir = Path(hf_dir)
    cfg = _read_json(hf_dir / CONFIG_NAME)
    args = Glm5ModelArgs.from_hf_config(cfg, **dict(overrides or {}))
    quant = _quantization_config(cfg)
    block = tuple(quant.get("weight_block_size") or (128, 128))
    not_convert = list(quant.get("modules_to_not_convert") or [])
    adapter = Glm5StateDictAdapter(args)
    files, weight_map = _checkpoint_files(hf_dir)

    with ExitStack() as stack:
        handles = _open_files(stack, files)
        where, meta = _scan(handles, weight_map)
        pairs = adapter.split_fp8_scales(meta, block=block, modules_to_not_convert=not_convert)
        scales = set(pairs.values())
        report = adapter.check_hf({k: s for k, (_, s) in meta.items() if k not in scales},
                                  allow_missing_mtp=allow_missing_mtp, where={k: p.name for k, p in where.items()})

        with torch.device("meta"):
            model = Glm5Model(args)
        _cast_for_load(model, dtype)
        model.to_empty(device=device)
        targets = model.state_dict(keep_vars=True)
        want = set(adapter.internal_names())
        if want != set(targets):
            raise RuntimeError("state dict adapter and Glm5Model disagree: adapter-only "
                               f"{sorted(want - set(targets))}, model-only {sorted(set(targets) - want)}")

        origin = HfOrigin(path=str(hf_dir), config=copy.deepcopy(cfg), missing_mtp=bool(report.missing_mtp),
                          quantized=bool(pairs))
        ignored = set(report.ignored)
        filled: set[tuple[str, int | None]] = set()
        with torch.no_grad():
            for name in sorted(meta, key=lambda n: (str(where[n]), n)):
                if name in scales:
                    continue
                path = where[name]
                try:
                    t = handles[path].get_tensor(name)
                    if name in ignored:
                        if keep_extra_tensors:
                            origin.extra[name] = t
                        continue
                    if name in pairs:
                        t = dequantize_fp8_blockwise(t, handles[where[pairs[name]]].get_tensor(pairs[name]), block)
                    else:
                        origin.dtypes[name] = t.dtype
                except Exception as e:
                    raise OSError(f"cannot read tensor {name} from {path}: {e}") from e
                ours, e = adapter.hf_to_internal(name)
                (targets[ours] if e is None else targets[ours][e]).copy_(t)
                filled.add((ours, e))
            if args.tie_word_embeddings and LM_HEAD not in meta:
                targets["lm_head.weight"].copy_(targets["embed_tokens.weight"])
                filled.add(("lm_head.weight", None))
        if report.missing_mtp:
            model.mtp.init_weights()
            filled.update((n, None) for n in targets if n.startswith("mtp."))
            logger.warning("%s has no MTP layer (layers.%d.*): the MTP module keeps a fresh initialisation",
                           hf_dir, args.num_hidden_layers)
        n_experts = args.n_routed_experts
        unfilled = [n for n in targets if (n, None) not in filled
                    and not all((n, x) in filled for x in range(n_experts))]
        if unfilled:  # unreachable when check_hf passed; guards adapter/model drift
            raise CheckpointMismatchError(f"model tensors not loaded from {hf_dir}: {unfilled[:12]}", missing=unfilled)
    if pairs:
        logger.info("dequantised %d FP8 block-scaled tensors from %s", len(pairs), hf_dir)
    model.hf_origin = origin
    return model


# ---------------------------------------------------------------------- writing
def _fp32_hf_names(model: Glm5Model, adapter: Glm5StateDictAdapter) -> set[str]:
    names: set[str] = set()
    for prefix, module in model.named_modules():
        if getattr(type(module), "keep_fp32", False):
            for n, _ in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
                hf = adapter.internal_to_hf(f"{prefix}.{n}" if prefix else n)
                names.update(hf if isinstance(hf, list) else [hf])
    return names


FP8_BLOCK = 128


def _scale_numel(t: torch.Tensor) -> int:
    rows, cols = fp8_scale_shape(tuple(t.shape), FP8_BLOCK)
    return rows * cols


def check_keep_bf16(keep_bf16: Iterable[str]) -> None:
    """ValueError naming each role of an export's keep_bf16 that the [float8] section would refuse: a typo would
    otherwise export that role's Linears in FP8 (and drop them from modules_to_not_convert) without a word."""
    if isinstance(keep_bf16, str):
        raise ValueError(f"keep_bf16: a list of roles, got the string {keep_bf16!r}")
    unknown = [r for r in keep_bf16 if r not in FLOAT8_ROLES]
    if unknown:
        raise ValueError(f"keep_bf16: unknown role(s) {unknown}; roles are {list(FLOAT8_ROLES)} (routed experts "
                         "are always FP8 in an FP8 export)")


def _fp8_export_names(model: Glm5Model, adapter: Glm5StateDictAdapter, keep_bf16) -> set[str]:
    """HF names of the weights the FP8 split runs in FP8: converted Linears and the routed experts."""
    from torchtitan_glm.float8 import fp8_convertible
    from .moe import GroupedExperts

    ours = [f"{fqn}.weight" for fqn in fp8_convertible(model, keep_bf16=keep_bf16)]
    ours += [f"{prefix}.{n}" for prefix, m in model.named_modules() if isinstance(m, GroupedExperts)
             for n, _ in m.named_parameters(recurse=False)]
    out: set[str] = set()
    for name in ours:
        hf = adapter.internal_to_hf(name)
        out.update(hf if isinstance(hf, list) else [hf])
    return out


def _indexer_hf_modules(model: Glm5Model, adapter: Glm5StateDictAdapter) -> set[str]:
    """HF module names of the DSA indexers (their k_norm and index_kpool_compress_* tensors included)."""
    from .dsa import KPoolIndexer

    return {adapter.internal_to_hf(f"{p}.wk.weight").removesuffix(".wk.weight")
            for p, m in model.named_modules() if isinstance(m, KPoolIndexer)}


def fp8_quantization_config(shapes: Mapping[str, tuple[int, ...]], quantized: set[str],
                            indexer_modules: set[str]) -> dict[str, Any]:
    """config.json's quantization_config of an FP8 export: every 2-D weight left unquantised, and each indexer
    the export keeps BF16 whole (k_norm and index_kpool_compress_* included), listed in modules_to_not_convert.
    An indexer with an E4M3 weight (float8.keep_bf16 without "indexer") is not listed whole: a loader would
    refuse its FP8 tensors."""
    whole = {m for m in indexer_modules if not any(q.startswith(m + ".") for q in quantized)}
    not_convert = sorted({n.rsplit(".", 1)[0] for n, shape in shapes.items() if n not in quantized
                          and n.endswith(".weight") and len(shape) == 2} | whole)
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK], "modules_to_not_convert": not_convert}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _export_config(model: Glm5Model, origin: HfOrigin | None, dtype: torch.dtype | None) -> dict[str, Any]:
    """The loaded config.json when it still describes the model (minus FP8 quantization), else one built from args."""
    args = model.args
    text = {k: v for k, v in args.to_hf_config().items() if k not in ("architectures", "model_type")}
    if origin is not None:
        cfg = copy.deepcopy(origin.config)
        cfg.pop("quantization_config", None)
        if isinstance(cfg.get("text_config"), dict):
            cfg["text_config"].pop("quantization_config", None)
        reread = Glm5ModelArgs.from_hf_config(cfg, **{k: getattr(args, k) for k in TRAINER_FIELDS if k != "hc_head"})
        if reread != args:
            logger.info("model args differ from the loaded config.json; updating its text keys")
            (cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg).update(text)
    else:
        cfg = {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
               "text_config": args.to_hf_config(), "tie_word_embeddings": args.tie_word_embeddings}
        dtype = dtype or next(p.dtype for n, p in model.named_parameters() if n == "embed_tokens.weight")
    # The head is exported as its own tensor beside the embedding (the model trains it untied): a config saying
    # tied would make a loader drop the trained head.
    cfg["tie_word_embeddings"] = False
    if isinstance(cfg.get("text_config"), dict) and "tie_word_embeddings" in cfg["text_config"]:
        cfg["text_config"]["tie_word_embeddings"] = False
    if dtype is not None:
        cfg["dtype"] = _dtype_name(dtype)
        if "torch_dtype" in cfg:
            cfg["torch_dtype"] = _dtype_name(dtype)
    return cfg


def _plan_shards(sizes: Mapping[str, int], max_shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def check_extra_files(extra_files: Mapping[str, bytes] | None) -> None:
    """ValueError for an extra file name that is not a plain file name or that the checkpoint itself writes."""
    for name in extra_files or {}:
        if Path(name).name != name or name in ("", ".", "..") or name == CONFIG_NAME or name == INDEX_FILE \
                or name.endswith(".safetensors"):
            raise ValueError(f"extra file {name!r}: not a plain file name, or one the HF checkpoint writes itself")


def write_extra_files(folder: Path, extra_files: Mapping[str, bytes] | None) -> None:
    """Each extra file into `folder` (the unpublished temporary one), byte for byte."""
    for name, data in (extra_files or {}).items():
        with open(folder / name, "wb") as f:
            f.write(data)


def _publish(tmp: Path, out_dir: Path) -> None:
    """Move the finished tmp dir to out_dir; an existing out_dir is replaced only once tmp is complete."""
    backup = None
    if out_dir.exists():
        backup = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out_dir, backup)
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        if backup is not None:
            os.rename(backup, out_dir)
        raise
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)


def save_pretrained(
    model: Glm5Model,
    out_dir: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    include_mtp: bool | None = None,
    config: Mapping[str, Any] | None = None,
    fp8: bool = False,
    keep_bf16: Iterable[str] | None = None,
    extra_files: Mapping[str, bytes] | None = None,
) -> Path:
    """Write `model` as an HF checkpoint (config.json + model.safetensors, or shards + index) and return out_dir.

    fp8: the released FP8 layout for serving: the Linears the FP8 split converts (float8.fp8_convertible with
    `keep_bf16`: roles of config.FLOAT8_ROLES, default the serving split; only with fp8) and the routed experts as
    E4M3 with 128x128 block `weight_scale_inv`, everything else in `dtype`;
    config.json's quantization_config lists every module left unquantised in `modules_to_not_convert` (the whole
    indexer, KDA projections, MLA attention, head, router, ...).

    dtype None writes each tensor in the dtype it had in the loaded HF files (`model.hf_origin`), else in its
    parameter dtype; an explicit dtype casts every floating tensor except those of `keep_fp32` modules (FP32).
    config.json is the loaded one (FP8 quantization removed) when it still matches model.args, else the multimodal
    form built from args; `config` overrides it. include_mtp None exports the MTP unless it was freshly initialised
    on load (the source had none). Everything is written to a temporary sibling directory that replaces out_dir
    only when complete; an existing non-empty out_dir is refused unless overwrite. extra_files: more files of the
    folder by name (the tokenizer's, `Tokenizer.hf_files()`), written before it is published.
    """
    out_dir = Path(out_dir)
    check_extra_files(extra_files)
    if keep_bf16 is not None and not fp8:
        raise ValueError("keep_bf16 chooses what an FP8 export keeps BF16: pass fp8=True with it, or drop it")
    keep_bf16 = SERVING_BF16_ROLES if keep_bf16 is None else tuple(keep_bf16)
    check_keep_bf16(keep_bf16)
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir} is not empty; pass overwrite=True to replace it")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    args = model.args
    adapter = Glm5StateDictAdapter(args)
    origin: HfOrigin | None = getattr(model, "hf_origin", None)
    if include_mtp is None:
        include_mtp = model.mtp is not None and not (origin is not None and origin.missing_mtp)
        if model.mtp is not None and not include_mtp:
            logger.warning("not exporting the MTP layer: it was freshly initialised on load (pass include_mtp=True)")
    elif include_mtp and model.mtp is None:
        raise ValueError("include_mtp=True but the model has no MTP layer")

    state = {}
    for name, t in model.state_dict().items():
        if name.startswith("mtp.") and not include_mtp:
            continue
        t = t.detach()
        state[name] = t.full_tensor() if hasattr(t, "full_tensor") else t
    tensors = adapter.to_hf(state, allow_missing_mtp=not include_mtp)
    fp32 = _fp32_hf_names(model, adapter)
    mtp_prefix = f"model.language_model.layers.{args.num_hidden_layers}."
    for name, t in (origin.extra.items() if origin is not None else ()):
        if name.startswith(mtp_prefix) and not include_mtp:
            continue
        tensors.setdefault(name, t)

    quantized = _fp8_export_names(model, adapter, keep_bf16) & set(tensors) if fp8 else set()

    def target_dtype(name: str, t: torch.Tensor) -> torch.dtype:
        if not t.is_floating_point():
            return t.dtype
        if dtype is None:
            return origin.dtypes.get(name, t.dtype) if origin is not None else t.dtype
        return torch.float32 if name in fp32 else dtype

    names = sorted(tensors)
    dtypes = {n: torch.float8_e4m3fn if n in quantized else target_dtype(n, tensors[n]) for n in names}
    sizes = {n: tensors[n].numel() * dtypes[n].itemsize + (4 * _scale_numel(tensors[n]) if n in quantized else 0)
             for n in names}
    shards = _plan_shards(sizes, max_shard_bytes)
    files = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    cfg = dict(config) if config is not None else _export_config(model, origin, dtype)
    if quantized:
        cfg["quantization_config"] = fp8_quantization_config({n: tuple(tensors[n].shape) for n in names}, quantized,
                                                             _indexer_hf_modules(model, adapter))

    def shard_tensors(shard: list[str]) -> dict[str, torch.Tensor]:
        data = {}
        for n in shard:
            if n in quantized:
                data[n], data[n + SCALE_SUFFIX] = quantize_fp8_blockwise(tensors[n].to("cpu"), FP8_BLOCK)
            else:
                # copy=True: per-expert views share storage, which safetensors refuses; copies one shard at a time.
                data[n] = tensors[n].to(device="cpu", dtype=dtypes[n], copy=True).contiguous()
        return data

    from safetensors.torch import save_file

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        for fname, shard in zip(files, shards):
            data = shard_tensors(shard)
            save_file(data, str(tmp / fname), metadata={"format": "pt"})
            del data
        if len(files) > 1:
            weight_map = {n: f for f, shard in zip(files, shards) for n in shard}
            weight_map.update({n + SCALE_SUFFIX: weight_map[n] for n in quantized})
            index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
            with open(tmp / INDEX_FILE, "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
        with open(tmp / CONFIG_NAME, "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
        write_extra_files(tmp, extra_files)
        _publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("saved %d tensors in %d file(s) to %s", len(names), len(files), out_dir)
    return out_dir
