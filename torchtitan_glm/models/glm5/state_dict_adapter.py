"""Name/layout mapping between our in-memory GLM-5 state dict and the HF (transformers glm5_next) file layout.

Pure tensor-dict transforms, no I/O: renames, per-expert split/stack of the stacked MoE weights, the MTP module
stored as layer `num_hidden_layers`, strict name/shape checks against shapes derived from the args, and FP8
block-scaled dequantisation. File reading and writing live in hf_io.py.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from .args import DSA, Glm5ModelArgs

logger = logging.getLogger(__name__)

TEXT_PREFIX = "model.language_model."
LM_HEAD = "lm_head.weight"
SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn,)
_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
# Within one layer: our remainder <-> HF remainder, where they differ.
_LAYER_RENAMES = {
    "attn_hc.fn": "hc_attn_fn",
    "attn_hc.base": "hc_attn_base",
    "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn",
    "ffn_hc.base": "hc_ffn_base",
    "ffn_hc.scale": "hc_ffn_scale",
    "self_attn.decay.A_log": "self_attn.A_log",
    "self_attn.decay.dt_bias": "self_attn.dt_bias",
    "self_attn.indexer.kpool_ape.weight": "self_attn.indexer.index_kpool_compress_ape",
}
_LAYER_RENAMES_INV = {v: k for k, v in _LAYER_RENAMES.items()}
# Top level (besides embed/norm/lm_head): DeepSeek-V4-style learned stream contraction, only with hc_head="learned".
_TOP_RENAMES = {"hc_head.fn": "hc_head_fn", "hc_head.base": "hc_head_base", "hc_head.scale": "hc_head_scale"}
_TOP_RENAMES_INV = {v: k for k, v in _TOP_RENAMES.items()}
_HF_EXPERT = re.compile(r"^(.*)mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_OUR_EXPERT = re.compile(r"^(.*)mlp\.experts\.(gate_proj|up_proj|down_proj)$")
_HF_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not match the model: the message names every missing/unexpected/mis-shaped one."""

    def __init__(self, message: str, *, missing: Iterable[str] = (), unexpected: Iterable[str] = (),
                 mismatched: Mapping[str, tuple[tuple, tuple]] | None = None) -> None:
        super().__init__(message)
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        self.mismatched = dict(mismatched or {})


@dataclass
class HfLoadReport:
    """What a conversion from HF did besides plain copies (logged by the callers)."""

    missing_mtp: list[str] = field(default_factory=list)  # absent MTP tensors: the model keeps its own init
    ignored: list[str] = field(default_factory=list)  # vision tensors, MTP copies of the shared embedding/head
    dequantized: list[str] = field(default_factory=list)  # FP8 tensors dequantised with their `_scale_inv`


def dequantize_fp8_blockwise(weight: torch.Tensor, scale_inv: torch.Tensor, block: int | tuple[int, int] = 128,
                             *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight.float() * scale_inv, each scale covering one block x block tile of a 2-D [out, in] weight.

    scale_inv is [ceil(out / block), ceil(in / block)] (FP32, or UE8M0 which .float() decodes); edge tiles are
    partial. Computed in FP32, then cast to `dtype`.
    """
    bo, bi = (block, block) if isinstance(block, int) else tuple(block)
    if weight.ndim != 2:
        raise ValueError(f"FP8 block dequantisation needs a 2-D weight, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    want = (math.ceil(rows / bo), math.ceil(cols / bi))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"scale_inv shape {tuple(scale_inv.shape)} does not match weight {tuple(weight.shape)} "
                         f"with block {bo}x{bi} (expected {want})")
    w = weight.float()
    pad_r, pad_c = want[0] * bo - rows, want[1] * bi - cols
    if pad_r or pad_c:
        w = torch.nn.functional.pad(w, (0, pad_c, 0, pad_r))
    w = w.view(want[0], bo, want[1], bi) * scale_inv.float().to(w.device)[:, None, :, None]
    return w.view(want[0] * bo, want[1] * bi)[:rows, :cols].to(dtype)


def quantize_fp8_blockwise(weight: torch.Tensor,
                           block: int | tuple[int, int] = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 weight, FP32 scale_inv) of a 2-D [out, in] weight, one scale per block x block tile (edge tiles
    partial): scale_inv = tile amax / 448, the released checkpoints' layout; dequantize_fp8_blockwise inverts it."""
    bo, bi = (block, block) if isinstance(block, int) else tuple(block)
    if weight.ndim != 2:
        raise ValueError(f"FP8 block quantisation needs a 2-D weight, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    tiles = fp8_scale_shape((rows, cols), (bo, bi))
    w = torch.nn.functional.pad(weight.float(), (0, tiles[1] * bi - cols, 0, tiles[0] * bo - rows))
    w = w.view(tiles[0], bo, tiles[1], bi)
    scale_inv = (w.abs().amax(dim=(1, 3)) / 448.0).clamp_min(1e-12)
    q = (w / scale_inv[:, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(tiles[0] * bo, tiles[1] * bi)[:rows, :cols].contiguous(), scale_inv


def _tile_index(start: int, length: int, block: int, first_tile: int) -> torch.Tensor:
    return torch.arange(start, start + length) // block - first_tile


def dequantize_fp8_block_region(weight: torch.Tensor, scale_inv: torch.Tensor, *, row0: int, col0: int,
                                block: int | tuple[int, int] = 128, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """dequantize_fp8_blockwise of the region of a weight whose first element is (row0, col0) of the whole, e.g. one
    rank's shard; scale_inv holds the tiles covering the region (tile (row0 // block, col0 // block) first). The
    same FP32 products as the whole-tensor function, so the values are bit-identical."""
    bo, bi = (block, block) if isinstance(block, int) else tuple(block)
    rows = _tile_index(row0, weight.shape[0], bo, row0 // bo)
    cols = _tile_index(col0, weight.shape[1], bi, col0 // bi)
    return (weight.float() * scale_inv.float()[rows][:, cols].to(weight.device)).to(dtype)


def fp8_block_amax_region(weight: torch.Tensor, *, row0: int, col0: int, full_shape: tuple[int, int],
                          block: int | tuple[int, int] = 128) -> torch.Tensor:
    """The [ceil(out / block), ceil(in / block)] grid of per-tile max |w| of a 2-D weight, from the region of it
    whose first element is (row0, col0): tiles it does not touch are 0, so the grids of all regions combine by max."""
    bo, bi = (block, block) if isinstance(block, int) else tuple(block)
    grid = torch.zeros(fp8_scale_shape(full_shape, (bo, bi)), dtype=torch.float32, device=weight.device)
    if weight.numel() == 0:
        return grid
    t0, c0 = row0 // bo, col0 // bi
    t1, c1 = -(-(row0 + weight.shape[0]) // bo), -(-(col0 + weight.shape[1]) // bi)
    window = torch.zeros((t1 - t0) * bo, (c1 - c0) * bi, dtype=torch.float32, device=weight.device)
    window[row0 - t0 * bo:row0 - t0 * bo + weight.shape[0], col0 - c0 * bi:col0 - c0 * bi + weight.shape[1]] = \
        weight.float().abs()
    grid[t0:t1, c0:c1] = window.view(t1 - t0, bo, c1 - c0, bi).amax(dim=(1, 3))
    return grid


def fp8_scale_inv(amax: torch.Tensor) -> torch.Tensor:
    """The released scale_inv of a tile amax grid (tile amax / 448, floored), as quantize_fp8_blockwise makes it."""
    return (amax / 448.0).clamp_min(1e-12)


def quantize_fp8_block_region(weight: torch.Tensor, scale_inv: torch.Tensor, *, row0: int, col0: int,
                              block: int | tuple[int, int] = 128) -> torch.Tensor:
    """E4M3 of the region of a weight whose first element is (row0, col0), under the whole weight's scale_inv grid;
    bit-identical to that region of quantize_fp8_blockwise(whole)."""
    bo, bi = (block, block) if isinstance(block, int) else tuple(block)
    rows = torch.arange(row0, row0 + weight.shape[0]) // bo
    cols = torch.arange(col0, col0 + weight.shape[1]) // bi
    s = scale_inv.to(weight.device)[rows][:, cols]
    return (weight.float() / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def fp8_scale_shape(weight_shape: tuple[int, ...], block: int | tuple[int, int] = 128) -> tuple[int, int]:
    bo, bi = (block, block) if isinstance(block, int) else tuple(block)
    return (math.ceil(weight_shape[0] / bo), math.ceil(weight_shape[1] / bi))


def matches_module_pattern(tensor_name: str, patterns: Iterable[str]) -> bool:
    """Whether a tensor's module is listed in `modules_to_not_convert` (HF rule: a prefix ending on a name boundary,
    as a regex, or a suffix of the module name)."""
    module = tensor_name.rsplit(".", 1)[0] if tensor_name.endswith((".weight", ".bias")) else tensor_name
    for pat in patterns:
        try:
            hit = re.match(rf"(?:{pat})(?=\.|$)", module) is not None
        except re.error:
            hit = module.startswith(pat) and module[len(pat):len(pat) + 1] in ("", ".")
        if hit or module.endswith(pat):
            return True
    return False


def _attn_shapes(args: Glm5ModelArgs, layer_idx: int | None) -> dict[str, tuple[int, ...]]:
    """self_attn.* shapes of one layer (layer_idx None = the MTP layer: DSA with its own indexer)."""
    d = args.hidden_size
    is_dsa = layer_idx is None or args.layer_types[layer_idx] == DSA
    if not is_dsa:
        h, k, w = args.linear_num_heads, args.linear_head_dim, args.linear_conv_kernel_dim
        inner = h * k
        out = {f"{p}_proj.weight": (inner, d) for p in "qkv"}
        out.update({f"{p}_conv1d.weight": (inner, 1, w) for p in "qkv"})
        out.update({"A_log": (h,), "dt_bias": (inner,), "f_a_proj.weight": (k, d), "f_b_proj.weight": (inner, k),
                    "g_a_proj.weight": (k, d), "g_b_proj.weight": (inner, k), "b_proj.weight": (h, d),
                    "o_proj.weight": (d, inner), "o_norm.weight": (k,)})
        return out
    h = args.num_attention_heads
    out = {
        "q_a_proj.weight": (args.q_lora_rank, d),
        "q_a_layernorm.weight": (args.q_lora_rank,),
        "q_b_proj.weight": (h * args.qk_head_dim, args.q_lora_rank),
        "kv_a_proj_with_mqa.weight": (args.kv_lora_rank + args.qk_rope_head_dim, d),
        "kv_a_layernorm.weight": (args.kv_lora_rank,),
        "kv_b_proj.weight": (h * (args.qk_nope_head_dim + args.v_head_dim), args.kv_lora_rank),
        "o_proj.weight": (d, h * args.v_head_dim),
    }
    if args.attention_bias:
        out.update({"q_a_proj.bias": (args.q_lora_rank,),
                    "kv_a_proj_with_mqa.bias": (args.kv_lora_rank + args.qk_rope_head_dim,), "o_proj.bias": (d,)})
    if layer_idx is None or args.indexer_types[layer_idx] != "shared":
        ih, idim = args.index_n_heads, args.index_head_dim
        out.update({
            "indexer.wq_b.weight": (ih * idim, args.q_lora_rank),
            "indexer.wk.weight": (idim, d),
            "indexer.k_norm.weight": (idim,),
            "indexer.k_norm.bias": (idim,),
            "indexer.weights_proj.weight": (ih, d),
            "indexer.index_kpool_compress_ape": (args.index_kpool, idim),
            "indexer.index_kpool_compress_gate": (idim, d),
        })
    return out


def _mlp_shapes(args: Glm5ModelArgs, sparse: bool) -> dict[str, tuple[int, ...]]:
    d = args.hidden_size
    if not sparse:
        i = args.intermediate_size
        return {"gate_proj.weight": (i, d), "up_proj.weight": (i, d), "down_proj.weight": (d, i)}
    e, i = args.n_routed_experts, args.moe_intermediate_size
    s = i * args.n_shared_experts
    out = {"gate.weight": (e, d), "gate.e_score_correction_bias": (e,)}
    for x in range(e):
        out.update({f"experts.{x}.gate_proj.weight": (i, d), f"experts.{x}.up_proj.weight": (i, d),
                    f"experts.{x}.down_proj.weight": (d, i)})
    out.update({"shared_experts.gate_proj.weight": (s, d), "shared_experts.up_proj.weight": (s, d),
                "shared_experts.down_proj.weight": (d, s)})
    return out


def expected_hf_shapes(args: Glm5ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF text checkpoint (files, not transformers' in-memory names) with its shape."""
    d, n = args.hidden_size, args.hc_mult
    p = TEXT_PREFIX
    out: dict[str, tuple[int, ...]] = {f"{p}embed_tokens.weight": (args.vocab_size, d)}
    width = (2 + n) * n
    for i in range(args.num_hidden_layers):
        lp = f"{p}layers.{i}."
        for site in ("attn", "ffn"):
            out.update({f"{lp}hc_{site}_fn": (width, n * d), f"{lp}hc_{site}_base": (width,),
                        f"{lp}hc_{site}_scale": (3,)})
        out.update({f"{lp}input_layernorm.weight": (d,), f"{lp}post_attention_layernorm.weight": (d,)})
        out.update({f"{lp}self_attn.{k}": v for k, v in _attn_shapes(args, i).items()})
        out.update({f"{lp}mlp.{k}": v for k, v in _mlp_shapes(args, args.mlp_layer_types[i] == "sparse").items()})
    if args.hc_head == "learned":
        out.update({f"{p}hc_head_fn": (n, n * d), f"{p}hc_head_base": (n,), f"{p}hc_head_scale": (1,)})
    out[f"{p}norm.weight"] = (d,)
    out[LM_HEAD] = (args.vocab_size, d)
    out.update(expected_hf_mtp_shapes(args))
    return out


def expected_hf_mtp_shapes(args: Glm5ModelArgs) -> dict[str, tuple[int, ...]]:
    """The MTP layer's tensors (stored as layer num_hidden_layers, no hc_*); empty without MTP."""
    if args.num_nextn_predict_layers != 1:
        return {}
    d = args.hidden_size
    lp = f"{TEXT_PREFIX}layers.{args.num_hidden_layers}."
    out = {f"{lp}enorm.weight": (d,), f"{lp}hnorm.weight": (d,), f"{lp}eh_proj.weight": (d, 2 * d),
           f"{lp}input_layernorm.weight": (d,), f"{lp}post_attention_layernorm.weight": (d,),
           f"{lp}shared_head.norm.weight": (d,)}
    out.update({f"{lp}self_attn.{k}": v for k, v in _attn_shapes(args, None).items()})
    out.update({f"{lp}mlp.{k}": v for k, v in _mlp_shapes(args, True).items()})
    return out


def _fmt(names: Iterable[str], limit: int = 12) -> str:
    names = sorted(names)
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


class Glm5StateDictAdapter:
    """Converts between our state dict (stacked experts, `mtp.*`) and the HF checkpoint layout (exact inverse)."""

    def __init__(self, args: Glm5ModelArgs) -> None:
        self.args = args
        self.mtp_layer = args.num_hidden_layers
        self._expected = expected_hf_shapes(args)
        self._mtp_names = set(expected_hf_mtp_shapes(args))

    # ------------------------------------------------------------------ names
    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._expected)

    def is_ignored_hf_name(self, name: str) -> bool:
        """Tensors a text-only load skips: the vision tower and the MTP layer's copies of the shared embedding/head."""
        if name.startswith("model.visual.") or name.startswith("visual."):
            return True
        mtp = f"{TEXT_PREFIX}layers.{self.mtp_layer}."
        return name in (f"{mtp}embed_tokens.weight", f"{mtp}shared_head.head.weight")

    def hf_to_internal(self, name: str) -> tuple[str, int | None]:
        """HF tensor name -> (our state-dict name, expert index into the stacked tensor or None).

        Pure renaming; it does not check that the name belongs to this model (`check_hf` does)."""
        if name == LM_HEAD:
            return "lm_head.weight", None
        if not name.startswith(TEXT_PREFIX):
            raise CheckpointMismatchError(f"tensor {name!r} is not a text-model tensor", unexpected=[name])
        rest = name[len(TEXT_PREFIX):]
        m = _HF_LAYER.match(rest)
        if m is None:
            return _TOP_RENAMES_INV.get(rest, rest), None
        layer, sub = int(m.group(1)), m.group(2)
        head = "mtp." if layer == self.mtp_layer and self.args.num_nextn_predict_layers == 1 else f"layers.{layer}."
        e = _HF_EXPERT.match(sub)
        if e is not None:
            return f"{head}{e.group(1)}mlp.experts.{e.group(3)}", int(e.group(2))
        return head + _LAYER_RENAMES_INV.get(sub, sub), None

    def internal_to_hf(self, name: str) -> str | list[str]:
        """Our state-dict name -> HF name, or the list of per-expert HF names for a stacked expert tensor."""
        if name == "lm_head.weight":
            return LM_HEAD
        if name.startswith("mtp."):
            head, sub = f"layers.{self.mtp_layer}.", name[len("mtp."):]
        elif name.startswith("layers."):
            idx, sub = name[len("layers."):].split(".", 1)
            head = f"layers.{idx}."
        else:
            return TEXT_PREFIX + _TOP_RENAMES.get(name, name)
        e = _OUR_EXPERT.match(sub)
        if e is not None:
            return [f"{TEXT_PREFIX}{head}{e.group(1)}mlp.experts.{x}.{e.group(2)}.weight"
                    for x in range(self.args.n_routed_experts)]
        return TEXT_PREFIX + head + _LAYER_RENAMES.get(sub, sub)

    # ----------------------------------------------------------------- checks
    def check_hf(self, shapes: Mapping[str, tuple[int, ...]], *, allow_missing_mtp: bool = False,
                 where: Mapping[str, str] | None = None) -> HfLoadReport:
        """Validate HF tensor names/shapes (FP8 scales already paired off) against the args; raise naming offenders.

        Ignored names (vision, MTP embed/head copies) are reported, not loaded. With allow_missing_mtp, a checkpoint
        without any MTP tensor is accepted (the model keeps its initialised MTP); a partial MTP is still an error.
        """
        report = HfLoadReport()
        present = {}
        for name, shape in shapes.items():
            if self.is_ignored_hf_name(name):
                report.ignored.append(name)
            else:
                present[name] = tuple(shape)
        expected = dict(self._expected)
        if self.args.tie_word_embeddings and LM_HEAD not in present:
            expected.pop(LM_HEAD)  # tied: the head is filled from the embedding
        missing = set(expected) - set(present)
        if allow_missing_mtp and self._mtp_names and self._mtp_names <= missing:
            report.missing_mtp = sorted(self._mtp_names)
            missing -= self._mtp_names
        unexpected = set(present) - set(expected)
        mismatched = {k: (present[k], expected[k]) for k in set(present) & set(expected) if present[k] != expected[k]}

        def loc(name: str) -> str:
            return f"{name} (in {where[name]})" if where and name in where else name

        problems = []
        if missing:
            problems.append(f"missing tensors: {_fmt(missing)}")
        if unexpected:
            hint = ""
            if any(n.startswith(f"{TEXT_PREFIX}layers.{self.mtp_layer}.") for n in unexpected):
                hint = f" (layers.{self.mtp_layer}.* is the MTP layer: set num_nextn_predict_layers=1 to load it)"
            problems.append(f"unexpected tensors: {_fmt(loc(n) for n in unexpected)}{hint}")
        if mismatched:
            problems.append("shape mismatches: " + _fmt(f"{loc(k)} has {list(got)}, model expects {list(want)}"
                                                        for k, (got, want) in mismatched.items()))
        if problems:
            raise CheckpointMismatchError("HF checkpoint does not match the model args: " + "; ".join(problems),
                                          missing=missing, unexpected=unexpected, mismatched=mismatched)
        return report

    def split_fp8_scales(self, meta: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], *,
                         block: int | tuple[int, int] = 128,
                         modules_to_not_convert: Iterable[str] = ()) -> dict[str, str]:
        """Pair every FP8 weight with its `<name>_scale_inv`; raise naming orphans, wrong scale shapes, or FP8
        tensors of modules listed as not converted. meta: name -> (dtype, shape). Returns weight -> scale name."""
        not_convert = list(modules_to_not_convert)
        pairs, problems = {}, []
        for name, (dtype, shape) in meta.items():
            if name.endswith(SCALE_SUFFIX):
                base = name[: -len(SCALE_SUFFIX)]
                if base not in meta:
                    problems.append(f"scale {name} has no weight {base}")
                elif meta[base][0] not in FP8_DTYPES:
                    problems.append(f"scale {name} belongs to {base}, which is {meta[base][0]}, not FP8")
                continue
            if dtype not in FP8_DTYPES:
                continue
            scale = name + SCALE_SUFFIX
            if scale not in meta:
                problems.append(f"FP8 tensor {name} has no {scale}")
                continue
            if len(shape) != 2:
                problems.append(f"FP8 tensor {name} has shape {list(shape)}; only 2-D block-scaled weights are "
                                "supported")
                continue
            want = fp8_scale_shape(tuple(shape), block)
            if tuple(meta[scale][1]) != want:
                problems.append(f"{scale} has shape {list(meta[scale][1])}, expected {list(want)} for {list(shape)}")
                continue
            if not_convert and matches_module_pattern(name, not_convert):
                problems.append(f"FP8 tensor {name} belongs to a module listed in modules_to_not_convert")
                continue
            pairs[name] = scale
        if problems:
            raise CheckpointMismatchError("invalid FP8 checkpoint: " + "; ".join(problems))
        return pairs

    # ------------------------------------------------------------ conversions
    def to_hf(self, state_dict: Mapping[str, torch.Tensor], *,
              allow_missing_mtp: bool = False) -> dict[str, torch.Tensor]:
        """Our state dict -> HF names; stacked experts become per-expert views (no copies). Raises for names this
        args' model does not have. allow_missing_mtp: a state dict without `mtp.*` is exported without layer N."""
        out: dict[str, torch.Tensor] = {}
        for name, t in state_dict.items():
            hf = self.internal_to_hf(name)
            if isinstance(hf, list):
                if t.ndim != 3 or t.shape[0] != len(hf):
                    raise CheckpointMismatchError(
                        f"{name} has shape {list(t.shape)}; expected [{len(hf)}, out, in] stacked experts",
                        mismatched={name: (tuple(t.shape), ())})
                out.update(zip(hf, t.unbind(0)))
            else:
                out[hf] = t
        self.check_hf({k: tuple(v.shape) for k, v in out.items()}, allow_missing_mtp=allow_missing_mtp)
        return out

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor], *, allow_missing_mtp: bool = False,
                block: int | tuple[int, int] = 128,
                modules_to_not_convert: Iterable[str] = ()) -> dict[str, torch.Tensor]:
        """HF tensors -> our state dict (values exact; FP8 weights dequantised to FP32). See from_hf_with_report."""
        state, report = self.from_hf_with_report(hf_state_dict, allow_missing_mtp=allow_missing_mtp, block=block,
                                                 modules_to_not_convert=modules_to_not_convert)
        if report.missing_mtp:
            logger.warning("HF checkpoint has no MTP layer (layers.%d.*): the MTP keeps its initialisation",
                           self.mtp_layer)
        return state

    def from_hf_with_report(self, hf_state_dict: Mapping[str, torch.Tensor], *, allow_missing_mtp: bool = False,
                            block: int | tuple[int, int] = 128, modules_to_not_convert: Iterable[str] = ()
                            ) -> tuple[dict[str, torch.Tensor], HfLoadReport]:
        """HF tensors -> (our state dict, report). Raises CheckpointMismatchError naming missing, unexpected or
        mis-shaped tensors. With allow_missing_mtp, an absent MTP layer yields a state dict without `mtp.*`."""
        meta = {k: (v.dtype, tuple(v.shape)) for k, v in hf_state_dict.items()}
        pairs = self.split_fp8_scales(meta, block=block, modules_to_not_convert=modules_to_not_convert)
        scales = set(pairs.values())
        report = self.check_hf({k: s for k, (_, s) in meta.items() if k not in scales},
                               allow_missing_mtp=allow_missing_mtp)
        ignored = set(report.ignored)
        report.dequantized = sorted(set(pairs) - ignored)
        state: dict[str, torch.Tensor] = {}
        experts: dict[str, dict[int, torch.Tensor]] = {}
        for name, t in hf_state_dict.items():
            if name in scales or name in ignored:
                continue
            if name in pairs:
                t = dequantize_fp8_blockwise(t, hf_state_dict[pairs[name]], block)
            ours, e = self.hf_to_internal(name)
            if e is None:
                state[ours] = t
            else:
                experts.setdefault(ours, {})[e] = t
        for ours, parts in experts.items():
            state[ours] = torch.stack([parts[x] for x in range(self.args.n_routed_experts)])
        if "lm_head.weight" not in state:  # tied embeddings without a stored head (check_hf allowed it)
            state["lm_head.weight"] = state["embed_tokens.weight"]
        return state, report

    def internal_names(self, *, with_mtp: bool = True) -> list[str]:
        """Our state-dict names for these args (what a matching Glm5Model.state_dict() holds)."""
        names: dict[str, None] = {}
        for hf in self._expected:
            if with_mtp or hf not in self._mtp_names:
                names[self.hf_to_internal(hf)[0]] = None
        return list(names)
