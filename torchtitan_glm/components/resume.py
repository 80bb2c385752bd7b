"""What a resumed run must keep, and what it should be told: the run facts saved with each checkpoint (run.json),
the settings whose change breaks an exact resume, and what a changed LR schedule, layout or precision does at the
resume step."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from torchtitan_glm.components.lr_scheduler import lr_factor

__all__ = ["run_info", "resume_mismatches", "schedule_note", "layout_note", "precision_note", "optimizer_note",
           "precision_changes", "optimizer_changes"]

# Model arguments that follow other settings and may change between stages without changing any parameter.
_FREE_ARGS = ("dsa_attention", "dsa_dense_max_len", "dsa_mask_query_chunk", "dsa_mask_causal_rows",
              "indexer_tile_elements")
# Model arguments that change only what a module computes in (no parameter, no trainability): a resume across them
# carries everything over, and precision_note says so.
_PRECISION_ARGS = ("indexer_fp8_emulation", "mhc_fp32_mixing", "kpool_fp32_accumulate", "indexer_weights_fp32",
                   "indexer_k_norm_fp32")


def run_info(*, cfg: Any, args: Any, tokenizer_vocab_size: int, layout: str | None = None,
             global_batch_rows: int | None = None, optimizer_step: str | None = None) -> dict[str, Any]:
    """The facts about this run saved with its checkpoints (JSON): the whole config, the model arguments, the
    parallel layout (ParallelDims.describe), the global batch in rows and the optimizer implementation that ran
    (optimizer.implementation resolved: "auto" is one of the others)."""
    model_args = {k: v for k, v in dataclasses.asdict(args).items() if k not in _FREE_ARGS}
    return json.loads(json.dumps({"config": cfg.to_dict(), "model_args": model_args,
                                  "tokenizer_vocab_size": tokenizer_vocab_size, "layout": layout,
                                  "global_batch_rows": global_batch_rows, "optimizer_step": optimizer_step},
                                 default=str))


def _exact_keys(info: dict[str, Any]) -> dict[str, Any]:
    """The settings an exact resume needs unchanged, by the name a user knows them."""
    cfg = info.get("config", {})
    out = {"training.seq_len": cfg.get("training", {}).get("seq_len"),
           # each implementation has its own state layout (AdamW8bit's quantised moments, tensor lr): none loads
           # into another
           "optimizer.name": cfg.get("optimizer", {}).get("name"),
           # the dense warm-up trains the indexer alone: its optimizer state and param groups are of other
           # parameters than the sparse stage's (the next stage starts from its weights: initial_load_path)
           "loss.indexer_stage": cfg.get("loss", {}).get("indexer_stage"),
           "model.flavor": cfg.get("model", {}).get("flavor"),
           "model.hf_config": cfg.get("model", {}).get("hf_config"),
           "tokenizer vocabulary size (data.tokenizer)": info.get("tokenizer_vocab_size")}
    if cfg.get("model", {}).get("hf_config"):
        out.pop("model.flavor")  # ignored when hf_config is set
    out.update({f"model.{k}": v for k, v in info.get("model_args", {}).items() if k not in _PRECISION_ARGS})
    return out


def resume_mismatches(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'key was X, is Y' for each setting that differs between a checkpoint's run and this one (configuration keys
    first, then model arguments); empty when an exact resume is possible."""
    old, new = _exact_keys(saved), _exact_keys(current)
    out = [f"{k} was {old[k]!r}, is {new[k]!r}" for k in new if k in old and old[k] != new[k]]
    # the MTP layer follows loss.mtp_weight (0 drops it): name the key the user set
    mtp = "model.num_nextn_predict_layers"
    was_w, is_w = (info.get("config", {}).get("loss", {}).get("mtp_weight") for info in (saved, current))
    if mtp in old and mtp in new and old[mtp] != new[mtp] and was_w != is_w and 0 in (was_w, is_w):
        out = [f"loss.mtp_weight was {was_w!r}, is {is_w!r} (0 trains without the MTP layer: {mtp} was {old[mtp]!r}, "
               f"is {new[mtp]!r})" if m.startswith(f"{mtp} ") else m for m in out]
    return out


def _lr(cfg: dict[str, Any], step: int, peak: float) -> float:
    s = cfg["lr_scheduler"]
    return peak * lr_factor(step, warmup_steps=s["warmup_steps"], total_steps=cfg["training"]["steps"],
                            decay_type=s["decay_type"], decay_ratio=s["decay_ratio"], min_lr_factor=s["min_lr_factor"])


def schedule_note(saved: dict[str, Any], current: dict[str, Any], step: int) -> str | None:
    """One sentence on what the LR does when a run resumes at `step` with a changed schedule (None: the LR of every
    step left is what the saved schedule gives, e.g. a changed `training.steps` that moves no decay).

    The resumed scheduler keeps its position (the step) and runs this run's schedule at this run's peak lr
    (optimizer.lr), so a lowered lr applies from the resume step on."""
    old_cfg, new_cfg = saved.get("config"), current["config"]
    if not old_cfg:
        return None
    keys = [("optimizer", "lr"), ("training", "steps")] + [("lr_scheduler", k) for k in new_cfg["lr_scheduler"]]
    changed = [f"{sec}.{k} {old_cfg[sec][k]!r} -> {new_cfg[sec][k]!r}" for sec, k in keys
               if old_cfg.get(sec, {}).get(k) != new_cfg[sec][k]]
    old_peak, new_peak = old_cfg["optimizer"]["lr"], new_cfg["optimizer"]["lr"]
    end = new_cfg["training"]["steps"]
    # the first step left whose LR differs (the saved schedule holds its final LR past its own end)
    first = next((s for s in range(step, end) if changed and not math.isclose(
        _lr(old_cfg, s, old_peak), _lr(new_cfg, s, new_peak), rel_tol=1e-12)), None)
    if first is None:
        return None
    before, after = _lr(old_cfg, first, old_peak), _lr(new_cfg, first, new_peak)
    where = f"step {first + 1}" if first == step else f"the same LR to step {first}, then step {first + 1}"
    return (f"the LR schedule changed since the checkpoint ({', '.join(changed)}): {where} runs at lr {after:.3g} "
            f"where the saved schedule gives {before:.3g}, then follows the new schedule to lr "
            f"{_lr(new_cfg, end - 1, new_peak):.3g} at step {end}")


def layout_note(saved: dict[str, Any], current: dict[str, Any], *, next_row: int) -> str | None:
    """One sentence on a resume under another parallel layout, global batch or data.document_masking (None: none
    changed).

    Model and optimizer state are resharded by DCP and the data continues at the saved global row, so a changed
    layout with the same global batch computes the uninterrupted run's losses (to reduction-order round-off). The
    rows are the same whether documents are masked or not; what the model attends and which labels count change."""
    old_layout, new_layout = saved.get("layout"), current.get("layout")
    old_rows, new_rows = saved.get("global_batch_rows"), current.get("global_batch_rows")
    note = []
    if old_layout and new_layout and old_layout != new_layout:
        note.append(f"the parallel layout changed since the checkpoint ({old_layout} -> {new_layout}): its model and "
                    f"optimizer state are resharded onto this one and the data continues at global row {next_row}")
    if old_rows and new_rows and old_rows != new_rows:
        note.append(f"the global batch changed from {old_rows} to {new_rows} rows per step (training.global_batch_size"
                    f"; -1: local_batch_size x the data-parallel degree): the data continues at global row {next_row},"
                    f" in batches of {new_rows}; set training.global_batch_size = {old_rows} to continue the same "
                    "batches")
    old_mask, new_mask = (info.get("config", {}).get("data", {}).get("document_masking", True)
                          for info in (saved, current))
    if old_mask != new_mask:
        note.append(f"data.document_masking changed from {str(old_mask).lower()} to {str(new_mask).lower()}: the "
                    f"same rows continue at global row {next_row}, from here on "
                    + ("with attention, state and labels restarting at each document" if new_mask else
                       "each as one causal sequence, every label counted"))
    return "; ".join(note) or None


def _precision(cfg: dict[str, Any]) -> str:
    f8 = cfg.get("float8", {})
    param = cfg.get("training", {}).get("mixed_precision_param")
    if not f8.get("enable"):
        return f"{param} (float8 off)"
    experts = ", FP8 grouped experts" if f8.get("moe_experts") else ""
    return f"FP8 {f8.get('recipe')}{experts}, kept {param}: {', '.join(f8.get('keep_bf16', [])) or 'none'}"


def precision_note(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """One sentence on a resume under other compute precisions ([float8], training.mixed_precision_param, the
    model's precision controls; None: unchanged). Parameter names and values carry over as they are; only what the
    GEMMs and the controlled ops compute in changes."""
    changed = precision_changes(saved, current)
    if not changed:
        return None
    old_cfg, new_cfg = saved["config"], current["config"]
    summary = _precision(old_cfg) != _precision(new_cfg)
    return (f"the compute precision changed since the checkpoint ({', '.join(changed)}): the weights and optimizer "
            "state carry over unchanged" + (f"; the steps trained so far ran {_precision(old_cfg)}, from here on "
                                            f"{_precision(new_cfg)}" if summary else ""))


def precision_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'key old -> new' for each compute-precision setting that differs and changes what is computed ([float8]
    keys only while float8 is on before or after)."""
    old_cfg, new_cfg = saved.get("config"), current["config"]
    if not old_cfg:
        return []
    keys = [("float8", k) for k in new_cfg.get("float8", {})] + [("training", "mixed_precision_param")]
    changed = [f"{sec}.{k} {old_cfg.get(sec, {}).get(k)!r} -> {new_cfg[sec][k]!r}" for sec, k in keys
               if old_cfg.get(sec, {}).get(k) != new_cfg[sec][k]]
    summary = _precision(old_cfg) != _precision(new_cfg)
    if not summary:
        changed = []
    old_args, new_args = saved.get("model_args", {}), current.get("model_args", {})
    return changed + [f"model.{k} {old_args[k]!r} -> {new_args[k]!r}" for k in _PRECISION_ARGS
                      if k in old_args and k in new_args and old_args[k] != new_args[k]]


def optimizer_note(saved: dict[str, Any], current: dict[str, Any], step: int) -> str | None:
    """One sentence on a resume with other [optimizer] settings than the checkpoint's (None: unchanged). The moments
    carry over; this run's betas, eps, weight decay and implementation apply from step `step` + 1 (the checkpoint
    loads this run's param groups). name (refused) and lr (schedule_note) have their own rules."""
    changed = optimizer_changes(saved, current)
    if not changed:
        return None
    return (f"the optimizer settings changed since the checkpoint ({', '.join(changed)}): its moments carry over and "
            f"the new settings apply from step {step + 1}")


def optimizer_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'optimizer.key old -> new' for each [optimizer] setting that differs, but name and lr (their own rules); the
    implementation as it ran where both runs recorded it ("auto" and what it resolved to are the same step)."""
    old, new = saved.get("config", {}).get("optimizer"), current["config"]["optimizer"]
    if not old:
        return []
    ran = {"old": saved.get("optimizer_step"), "new": current.get("optimizer_step")}
    if ran["old"] and ran["new"]:
        old, new = {**old, "implementation": ran["old"]}, {**new, "implementation": ran["new"]}
    return [f"optimizer.{k} {old[k]!r} -> {v!r}" for k, v in new.items()
            if k not in ("name", "lr") and k in old and old[k] != v]
