"""Per-block torch.compile(fullgraph=True) of decoder layers, the MTP layer and the LM-head loss.

Every kernel that would break the graph sits behind a torch.library custom op (ops/), so the blocks compile whole;
MoE routing is data-dependent only in values (static shapes), so steps with new routing or new document
boundaries reuse the same graph.
"""

from __future__ import annotations

from torch import nn

COMPONENTS = ("model", "loss")


def compile_unit(block: nn.Module) -> nn.Module:
    """The module torch.compile compiles for a decoder layer or the MTP layer: the block itself under full AC (its
    checkpoint stays eager around the compiled code), else the layer as wrapped.

    Full AC traced into the graph (torch.utils.checkpoint under dynamo) relies on AOTAutograd tagging every op of the
    region for recompute. torch 2.11 leaves the ops inside autograd.Functions untagged (the mHC projection, the KDA
    gate, the gated norm, the MoE dispatch and SwiGLU here), and the min-cut partitioner then saves their outputs as
    if there were no checkpoint: the proxy at T = 32,768 kept about 30 GiB of them and ran out of memory on an H100
    where eager full AC peaks at 53.8 GiB (docs/performance.md, thirty-first session). An eager checkpoint around
    the compiled block saves only its inputs on any torch version; backward re-runs the compiled forward."""
    return block._checkpoint_wrapped_module if getattr(block, "compile_inside", False) else block


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
            compile_unit(layer).compile(**options)
        if getattr(model, "mtp", None) is not None:
            compile_unit(model.mtp).compile(**options)
    if "loss" in components:
        model.lm_head.compile(**options)
