"""HF checkpoint I/O for a parallelized (FSDP2-sharded) Glm5Model: the trainer's initial load and final export.

Both go through full state dicts (torch.distributed.checkpoint.state_dict), so they work for any sharding; each
rank reads the HF files itself (no broadcast), and rank 0 alone writes the export.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from .hf_io import from_pretrained, save_pretrained
from .model import Glm5Model


def load_hf_weights_into(model: nn.Module, hf_dir: str | os.PathLike) -> None:
    """Copy an HF checkpoint's weights into `model` (sharded or not); shapes must match the model's args."""
    source = from_pretrained(hf_dir, dtype=torch.float32)
    full = source.state_dict()
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=True))


def save_hf_from_sharded(model: nn.Module, out_dir: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16,
                         fp8: bool = False, keep_bf16: tuple[str, ...] | list[str] = ("indexer", "mla", "kda")) -> None:
    """Gather the full weights and write them (rank 0) in the released HF layout (FP8 block-scaled with `fp8`);
    other ranks wait."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        args = _unwrap(model).args
        with torch.device("meta"):
            cpu_model = Glm5Model(args)
        cpu_model.to_empty(device="cpu")
        cpu_model.load_state_dict(full, strict=True)
        save_pretrained(cpu_model, out_dir, dtype=dtype, overwrite=False, fp8=fp8, keep_bf16=keep_bf16)
    if dist.is_initialized():
        dist.barrier()


def _unwrap(model: nn.Module) -> Glm5Model:
    return getattr(model, "_orig_mod", model)
