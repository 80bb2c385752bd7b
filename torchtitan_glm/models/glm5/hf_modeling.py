"""transformers glm5_next's in-memory (modeling) parameter names -> ours, for models built side by side.

HF checkpoint files go through state_dict_adapter.py; this maps a live `Glm5NextTextModel.state_dict()` (fused
q/k/v short conv and expert gate_up tensors, the forget gate's submodule names), which the benchmark against
transformers and the block-parity tests load into our modules.
"""

from __future__ import annotations

from typing import Mapping

import torch


def modeling_to_ours(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers glm5_next text-model state dict under our names (views of the given tensors)."""
    out = {}
    for name, t in state.items():
        n = name.replace("forget_gate.f_a_proj", "f_a_proj").replace("forget_gate.f_b_proj", "f_b_proj")
        n = n.replace("forget_gate.A_log", "decay.A_log").replace("forget_gate.dt_bias", "decay.dt_bias")
        n = n.replace("indexer.index_kpool_compress_ape", "indexer.kpool_ape.weight")
        if n.endswith("conv1d.weight") and "_conv1d" not in n:
            for part, chunk in zip("qkv", t.chunk(3, 0)):
                out[n.replace("conv1d", f"{part}_conv1d")] = chunk
        elif n.endswith("experts.gate_up_proj"):
            gate, up = t.chunk(2, 1)
            out[n.replace("gate_up_proj", "gate_proj")] = gate
            out[n.replace("gate_up_proj", "up_proj")] = up
        else:
            out[n] = t
    return out
