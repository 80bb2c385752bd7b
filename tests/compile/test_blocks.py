"""Each block type compiles whole (fullgraph, aot_eager) into one graph, runs forward+backward like eager, and
keeps its golden op count."""

from __future__ import annotations

import copy
from typing import NamedTuple

import pytest
import torch
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend
from torch._dynamo.utils import counters

from . import graph_ops
from .builders import (
    BLOCKS, assert_close, block_inputs, block_loss, block_of, build_model, clone_inputs, output_tensors,
)


class BlockRun(NamedTuple):
    record: dict  # golden entry (graphs, op counts)
    graph_breaks: dict
    outputs: list[torch.Tensor]
    ref_outputs: list[torch.Tensor]
    grads: dict[str, torch.Tensor | None]  # parameters and inputs, compiled
    ref_grads: dict[str, torch.Tensor | None]  # same, eager


def _grads(block: torch.nn.Module, inputs: tuple[tuple, dict]) -> dict[str, torch.Tensor | None]:
    grads = {f"param {n}": p.grad for n, p in block.named_parameters()}
    tensors = [a for a in inputs[0] if isinstance(a, torch.Tensor) and a.requires_grad]
    grads.update({f"input {i}": t.grad for i, t in enumerate(tensors)})
    return grads


def _run_block(name: str, args=None, *, one_doc: bool = False) -> BlockRun:
    torch._dynamo.reset()
    counters.clear()
    model = build_model(seed=0, args=args)
    block = block_of(model, name)
    reference = copy.deepcopy(block)
    inputs = block_inputs(model, name, one_doc=one_doc)
    ref_inputs = clone_inputs(inputs)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, fullgraph=True, backend=counter)
    out = compiled(*inputs[0], **inputs[1])
    block_loss(out).backward()
    breaks = {k: dict(v) if hasattr(v, "items") else v for k, v in counters["graph_break"].items()}

    ref_out = reference(*ref_inputs[0], **ref_inputs[1])
    block_loss(ref_out).backward()
    return BlockRun(graph_ops.record(counter), breaks, output_tensors(out), output_tensors(ref_out),
                    _grads(block, inputs), _grads(reference, ref_inputs))


@pytest.fixture(scope="module")
def block_runs():
    """name -> BlockRun, each block compiled once per module (shared by the fullgraph and golden tests)."""
    runs: dict[str, BlockRun] = {}

    def get(name: str) -> BlockRun:
        if name not in runs:
            runs[name] = _run_block(name)
        return runs[name]

    return get


@pytest.mark.parametrize("name", list(BLOCKS))
def test_block_compiles_fullgraph_and_matches_eager(block_runs, name):
    run = block_runs(name)
    assert run.graph_breaks == {}, f"{name}: graph breaks {run.graph_breaks}"
    assert run.record["graphs"] == 1, f"{name}: expected one compiled graph, got {run.record['graphs']}"
    if name.startswith("kda"):
        assert run.record["ops"].get("torch.ops.torchtitan_glm.kda_fwd") == 1, "KDA kernel is not one opaque op"
    if name.endswith("moe") or name == "mtp":
        grouped = run.record["ops"].get("torch.ops.torchtitan_glm.grouped_mm.default")
        assert grouped == 3, f"experts should be 3 grouped-GEMM ops, got {grouped}"

    _assert_matches_eager(run, name)


def _assert_matches_eager(run: BlockRun, name: str) -> None:
    """Compiled outputs and gradients (parameters and inputs) equal eager's."""
    assert len(run.outputs) == len(run.ref_outputs)
    for i, (got, want) in enumerate(zip(run.outputs, run.ref_outputs)):
        if want.is_floating_point():
            assert_close(got, want, f"{name} output {i}")
        else:  # masks, selections, expert counts: exact
            assert torch.equal(got, want), f"{name} output {i} ({want.dtype}) differs from eager"

    assert run.grads.keys() == run.ref_grads.keys()
    scale = max(g.abs().max().item() for g in run.ref_grads.values() if g is not None)
    for key, want in run.ref_grads.items():
        assert want is not None, f"{name}: eager left {key} without gradient (test input does not reach it)"
        got = run.grads[key]
        assert got is not None, f"{name}: compiled block left {key} without gradient"
        assert torch.isfinite(got).all(), f"{name}: non-finite gradient for {key}"
        assert_close(got, want, f"{name} grad {key}", atol=1e-6 * scale)


def test_golden_op_counts(block_runs):
    actual = {name: block_runs(name).record for name in BLOCKS}
    if graph_ops.update_requested():
        graph_ops.write_golden(actual)
        return
    golden = graph_ops.load_golden()
    diff = graph_ops.golden_diff(golden, actual)
    recorded = golden.get("_about", {}).get("torch")
    note = "" if recorded == torch.__version__ else f" (golden from torch {recorded}, running {torch.__version__})"
    if diff:
        pytest.fail(
            f"compiled graph op counts changed{note}:\n" + "\n".join(diff)
            + f"\nIf the change is intended, regenerate {graph_ops.GOLDEN_PATH.name} with:\n    {graph_ops.REGENERATE}"
        )


def test_op_count_independent_of_weights_and_data(block_runs):
    """Dynamo's graph for the DSA+MoE block (indexer selection, routing) does not depend on values: another seed
    and other document boundaries trace the same number of ops."""
    expected = block_runs("dsa_moe").record["op_count"]
    torch._dynamo.reset()
    model = build_model(seed=7)
    counter = CompileCounter()
    compiled = torch.compile(block_of(model, "dsa_moe"), fullgraph=True, backend=counter)
    args, kwargs = block_inputs(model, "dsa_moe", seed=7, step=3)
    compiled(*args, **kwargs)
    assert (counter.frame_count, counter.op_count) == (1, expected)


@pytest.mark.parametrize("one_doc", [False, True])
def test_dsa_block_with_the_dense_kernel_compiles_whole(one_doc):
    """A sparse-stage DSA block whose rows fit dsa_dense_max_len (masked SDPA under the selection's mask; with one
    document per row, its first 19 rows through the causal kernel without the mask) compiles into one graph without
    breaks, calls no sparse-MLA op and matches eager (outputs, gradients)."""
    from .builders import SEQLEN, debug_args

    run = _run_block("dsa_moe", debug_args(dsa_dense_max_len=SEQLEN), one_doc=one_doc)
    assert run.graph_breaks == {} and run.record["graphs"] == 1
    assert not any("sparse_mla" in op for op in run.record["ops"]), run.record["ops"]
    sdpa_calls = sum(n for op, n in run.record["ops"].items() if "scaled_dot_product" in op)
    assert sdpa_calls == 1 + one_doc, run.record["ops"]  # one masked call (after the causal rows)
    _assert_matches_eager(run, "dsa_moe (dense kernel)")
