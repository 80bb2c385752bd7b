"""Per-block torch.compile(fullgraph=True) of decoder layers, the MTP layer and the LM-head loss.

Every kernel that would break the graph sits behind a torch.library custom op (ops/), so the blocks compile whole;
MoE routing is data-dependent only in values (static shapes), so steps with new routing or new document
boundaries reuse the same graph.
"""

from __future__ import annotations

from torch import nn

COMPONENTS = ("model", "loss")


def apply_compile(model: nn.Module, *, backend: str, mode: str = "default", components: list[str]) -> None:
    """Compile in place (nn.Module.compile keeps parameter names) the blocks named by `components`."""
    unknown = set(components) - set(COMPONENTS)
    if unknown:
        raise ValueError(f"compile.components has unknown entries {sorted(unknown)}; choose from {COMPONENTS}")
    options = dict(backend=backend, fullgraph=True)
    if backend == "inductor" and mode != "default":
        options["mode"] = mode
    if "model" in components:
        for layer in model.layers.values():
            layer.compile(**options)
        if getattr(model, "mtp", None) is not None:
            model.mtp.compile(**options)
    if "loss" in components:
        model.lm_head.compile(**options)
