"""Op counts of captured Dynamo graphs and the golden-file comparison (tests/compile/golden_op_counts.json)."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import torch
import torch.fx

GOLDEN_PATH = Path(__file__).with_name("golden_op_counts.json")
UPDATE_ENV = "UPDATE_GOLDEN"
REGENERATE = f"{UPDATE_ENV}=1 python -m pytest tests/compile/test_blocks.py -k golden"


def op_name(node: torch.fx.Node) -> str:
    """Stable, address-free name of a call node's target (e.g. 'torch.sigmoid', 'Tensor.sum', 'torch.ops.x.y')."""
    target = node.target
    if node.op == "call_method":
        return f"Tensor.{target}"
    if node.op == "call_module":
        return f"module:{target}"
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"torch.ops.higher_order.{target.__name__}"
    if isinstance(target, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
        return f"torch.ops.{target}"
    module = getattr(target, "__module__", None) or ""
    module = {"torch._VariableFunctionsClass": "torch", "_operator": "operator"}.get(module, module)
    qualname = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)
    qualname = qualname.removeprefix("_VariableFunctionsClass.")
    return f"{module}.{qualname}" if module else qualname


def op_histogram(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Call nodes of the graph and of its nested subgraphs (autograd.Function and checkpoint bodies), by name."""
    hist: Counter[str] = Counter()
    for _, sub in gm.named_modules():
        if isinstance(sub, torch.fx.GraphModule):
            hist.update(op_name(n) for n in sub.graph.nodes if n.op.startswith("call"))
    return dict(sorted(hist.items()))


def record(counter) -> dict:
    """Golden entry for one compiled block from a CompileCounter(WithBackend) that captured only that block."""
    hist: Counter[str] = Counter()
    for gm in counter.graphs:
        hist.update(op_histogram(gm))
    return {"graphs": int(counter.frame_count), "op_count": int(counter.op_count),
            "nested_op_count": sum(hist.values()), "ops": dict(sorted(hist.items()))}


def load_golden() -> dict:
    if not GOLDEN_PATH.exists():
        return {}
    with open(GOLDEN_PATH) as f:
        return json.load(f)


def write_golden(actual: dict[str, dict]) -> None:
    data = {"_about": {"what": "Dynamo graph op counts per compiled block (debug flavor, B=2, T=32, fp32); "
                               "op_count is CompileCounter.op_count (top-level call nodes), ops counts nested "
                               "subgraphs too",
                       "torch": torch.__version__, "regenerate": REGENERATE}}
    data.update(dict(sorted(actual.items())))
    with open(GOLDEN_PATH, "w") as f:
        json.dump(data, f, indent=1, sort_keys=False)
        f.write("\n")


def golden_diff(expected: dict, actual: dict[str, dict]) -> list[str]:
    """Readable per-block differences (empty when everything matches)."""
    lines = []
    for block in sorted(set(actual) | {k for k in expected if not k.startswith("_")}):
        want, got = expected.get(block), actual.get(block)
        if want is None:
            lines.append(f"{block}: not in the golden file (actual op_count {got['op_count']})")
            continue
        if got is None:
            lines.append(f"{block}: in the golden file but no longer compiled by the test")
            continue
        for key in ("graphs", "op_count", "nested_op_count"):
            if want.get(key) != got[key]:
                lines.append(f"{block}: {key} expected {want.get(key)}, actual {got[key]} "
                             f"({got[key] - (want.get(key) or 0):+d})")
        want_ops, got_ops = want.get("ops", {}), got["ops"]
        for op in sorted(set(want_ops) | set(got_ops)):
            if want_ops.get(op, 0) != got_ops.get(op, 0):
                lines.append(f"    {block} {op}: expected {want_ops.get(op, 0)}, actual {got_ops.get(op, 0)}")
    return lines


def update_requested() -> bool:
    return os.environ.get(UPDATE_ENV, "") not in ("", "0")
