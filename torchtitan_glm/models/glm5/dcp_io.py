"""A Glm5Model from one of the trainer's DCP checkpoints, in one process (generation, agreement reports).

The trainer saves `step-N/` folders (components/checkpoint.py): DCP files with the model under "model.", and
`run.json` with the run's configuration and model arguments, which rebuild the model here.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from torchtitan_glm.components.checkpoint import RUN_INFO, list_checkpoints, step_dir

from .args import Glm5ModelArgs
from .hf_io import _cast_for_load
from .model import Glm5Model

__all__ = ["from_dcp", "resolve_step_folder"]


def resolve_step_folder(path: str) -> str:
    """`path` itself if it is a checkpoint (DCP .metadata), else the newest complete step-N folder in it (the
    trainer's checkpoint folder); OSError naming the path otherwise."""
    if os.path.isfile(os.path.join(path, ".metadata")):
        return path
    steps = list_checkpoints(path)
    if not steps:
        raise OSError(f"{path} is neither a DCP checkpoint (no .metadata) nor a folder of complete step-N checkpoints")
    return step_dir(path, steps[-1])


def from_dcp(path: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
             overrides: dict[str, Any] | None = None) -> tuple[Glm5Model, dict[str, Any]]:
    """(model, run.json) from a trainer checkpoint folder (see resolve_step_folder). The model arguments come from
    run.json (`overrides`: trainer-side fields such as dsa_attention); parameters are loaded in FP32, then cast to
    `dtype` except the FP32-kept modules'. The MTP layer is dropped when the run trained without one."""
    import torch.distributed.checkpoint as dcp

    folder = resolve_step_folder(path)
    info_path = os.path.join(folder, RUN_INFO)
    try:
        with open(info_path, encoding="utf-8") as f:
            info = json.load(f)
        model_args = dict(info["model_args"])
    except (OSError, ValueError, KeyError) as e:
        raise OSError(f"cannot read the model arguments from {info_path} ({e}); a trainer checkpoint has a run.json "
                      "next to its DCP files") from e
    args = Glm5ModelArgs(**{**model_args, **dict(overrides or {})})
    with torch.device("meta"):
        model = Glm5Model(args)
    model.to_empty(device=device)
    state = model.state_dict()
    keys = set(dcp.FileSystemReader(folder).read_metadata().state_dict_metadata)
    wanted = {f"model.{k}" for k in state}
    missing = sorted(k for k in wanted if k not in keys)
    if missing:
        raise OSError(f"checkpoint {folder} lacks model tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    dcp.load({"model": state}, checkpoint_id=folder, no_dist=True)  # in place: the tensors are the parameters
    _cast_for_load(model, dtype)
    return model.eval(), info
