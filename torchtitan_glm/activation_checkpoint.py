"""Activation checkpointing per decoder block (and the MTP layer): none | full | selective.

Full recomputes the whole block, mHC mixing included; the block is a pure function of its inputs, so the
recomputed forward re-reads the saved residual streams and never adds them twice. Selective saves the outputs of
matmuls, attention, the KDA kernel and the DSA indexer's tiled ops (selection, KL with its precomputed gradient),
and recomputes the cheap elementwise ops (norms, gates, mHC maps).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

MODES = ("none", "full", "selective")


def _save_list() -> set:
    ops = {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_cudnn_attention.default,
        torch.ops.aten._flash_attention_forward.default,
    }
    for name in ("_grouped_mm", "_scaled_mm", "_scaled_grouped_mm"):
        if hasattr(torch.ops.aten, name):
            ops.add(getattr(torch.ops.aten, name).default)
    for name in ("kda_fwd", "sparse_mla_fwd", "kpool_topk", "indexer_kl_sparse", "indexer_kl_dense"):
        if hasattr(torch.ops, "torchtitan_glm") and hasattr(torch.ops.torchtitan_glm, name):
            ops.add(getattr(torch.ops.torchtitan_glm, name).default)
    return ops


def _policy(save: set, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> tuple:
    return create_selective_checkpoint_contexts(functools.partial(_policy, _save_list()))


def wrap_block(block: nn.Module, *, mode: str) -> nn.Module:
    """The block wrapped for `mode` (checkpoint_wrapper keeps state_dict names free of its prefix)."""
    if mode == "none":
        return block
    if mode == "full":
        return checkpoint_wrapper(block, preserve_rng_state=False)
    if mode == "selective":
        return checkpoint_wrapper(block, preserve_rng_state=False, context_fn=_selective_context)
    raise ValueError(f"activation_checkpoint.mode must be one of {MODES}, got {mode!r}")


def apply_activation_checkpointing(model: nn.Module, *, mode: str) -> None:
    """Wrap every decoder layer and the MTP layer of a Glm5Model in place."""
    for name, layer in list(model.layers.items()):
        model.layers[name] = wrap_block(layer, mode=mode)
    if getattr(model, "mtp", None) is not None:
        model.mtp = wrap_block(model.mtp, mode=mode)
