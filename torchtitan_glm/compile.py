"""Per-block torch.compile(fullgraph=True) of decoder layers, the MTP layer and the LM-head loss.

Every kernel that would break the graph sits behind a torch.library custom op (ops/), so the blocks compile whole;
MoE routing is data-dependent only in values (static shapes), so steps with new routing or new document
boundaries reuse the same graph.
"""

from __future__ import annotations

from torch import nn

from torchtitan_glm.activation_checkpoint import for_compile

COMPONENTS = ("model", "loss")


def apply_compile(model: nn.Module, *, backend: str, mode: str = "default", components: list[str]) -> None:
    """Compile in place (nn.Module.compile keeps parameter names) the blocks named by `components`; a full-AC layer is
    first re-wrapped for compile (activation_checkpoint.for_compile)."""
    unknown = set(components) - set(COMPONENTS)
    if unknown:
        raise ValueError(f"compile.components has unknown entries {sorted(unknown)}; choose from {COMPONENTS}")
    options = dict(backend=backend, fullgraph=True)
    if backend == "inductor" and mode != "default":
        options["mode"] = mode
    if "model" in components:
        for name, layer in list(model.layers.items()):
            model.layers[name] = for_compile(layer)
            model.layers[name].compile(**options)
        if getattr(model, "mtp", None) is not None:
            model.mtp = for_compile(model.mtp)
            model.mtp.compile(**options)
    if "loss" in components:
        model.lm_head.compile(**options)
