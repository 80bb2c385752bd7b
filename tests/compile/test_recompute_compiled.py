"""recompute_modules under torch.compile (fullgraph, aot_eager: AOTAutograd runs the checkpoint policy while it
traces, so the labels come from the FX nodes' stack traces and module stacks, not the Python stack): the compiled
blocks attribute ops to the chosen module and give the eager no-recompute loss and gradients."""

from __future__ import annotations

import pytest
import torch

from tests.compile.builders import build_model, make_batch, train_forward, training_loss
from torchtitan_glm.activation_checkpoint import apply_activation_checkpointing
from torchtitan_glm.compile import apply_compile


def _step(modules: tuple[str, ...], *, compiled: bool, mode: str | None = None, moe_chunk_tokens: int = 0):
    model = build_model(0)
    mode = mode or ("selective" if modules else "none")
    apply_activation_checkpointing(model, mode=mode, recompute_modules=modules, moe_chunk_tokens=moe_chunk_tokens)
    if compiled:
        apply_compile(model, backend="aot_eager", components=["model"])
    batch = make_batch(0, model.args.vocab_size, bsz=1)
    n = int((batch.labels != -100).sum())
    loss = training_loss(train_forward(model, batch, token_scale=1.0 / n, mtp_scale=0.1 / n))
    loss.backward()
    grads = {name.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", ""): p.grad
             for name, p in model.named_parameters() if p.grad is not None}
    sites = [getattr(m, "recompute_sites", None) for m in list(model.layers.values()) + [model.mtp]]
    seen = set().union(*(s.seen for s in sites if s is not None)) if modules else set()
    return loss.detach(), grads, seen


@pytest.mark.parametrize("modules", [("kda", "mla_up_proj"),
                                     pytest.param(("mhc", "indexer", "moe"), marks=pytest.mark.slow)])
@pytest.mark.long
def test_compiled_choices_attribute_and_match_eager(modules):
    ref_loss, ref_grads, _ = _step((), compiled=False)
    loss, grads, seen = _step(modules, compiled=True)
    assert seen == set(modules), f"the policy attributed traced ops to {seen}"
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert grads.keys() == ref_grads.keys()
    for key, g in grads.items():
        torch.testing.assert_close(g, ref_grads[key], rtol=1e-4, atol=1e-6, msg=lambda m: f"{key}: {m}")


def _graphs(modules: tuple[str, ...]) -> int:
    """Graphs dynamo compiles for one training forward of the test model under selective AC + modules."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = build_model(0)
    apply_activation_checkpointing(model, mode="selective", recompute_modules=modules)
    apply_compile(model, backend="eager", components=["model"])
    batch = make_batch(0, model.args.vocab_size, bsz=1)
    train_forward(model, batch, token_scale=1.0, mtp_scale=0.1)
    return counters["stats"]["unique_graphs"]


def test_recompute_modules_compile_once_per_kind_of_block():
    """recompute_modules adds no graph: blocks of one kind share their compiled code, as under plain selective. A
    policy object per block made every block a recompile, and past dynamo's limit of 8 (the proxy's 8 layers and
    MTP) a fullgraph error."""
    assert _graphs(("kda", "mla_up_proj")) == _graphs(()) < len(build_model(0).layers) + 1


@pytest.mark.parametrize("mode", ["full", pytest.param("selective", marks=pytest.mark.slow)])
@pytest.mark.long
def test_compiled_moe_chunks_match_eager(mode):
    """activation_checkpoint.moe_chunk_tokens inside fullgraph-compiled blocks (nested checkpoints under full AC)."""
    ref_loss, ref_grads, _ = _step((), compiled=False)
    loss, grads, _ = _step((), compiled=True, mode=mode, moe_chunk_tokens=13)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert grads.keys() == ref_grads.keys()
    for key, g in grads.items():
        torch.testing.assert_close(g, ref_grads[key], rtol=1e-4, atol=1e-6, msg=lambda m: f"{key}: {m}")
