"""Which precision every parameter's compute runs in, for a training config: the model is built on the meta device
and converted by exactly the function training uses (float8.convert_float8), then read back from the module types.

    python scripts/precision_report.py --config train_configs/glm5_3_flash.toml [--json] [--section.key value ...]

Text: one row per parameter (fqn, role, precision), a count per (role, precision), and the share of training FLOPs
(forward + backward, the trainer's own count) that runs in FP8; with model.indexer_weights_fp32 a line says that the
indexer's weights_proj keeps its weight's precision but multiplies in FP32. JSON: a list of
{"fqn", "role", "precision"}. Every option other than --json is train.py's (`python train.py --help` lists them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchtitan_glm.components.logs import drop_benign_warnings  # noqa: E402

drop_benign_warnings()  # before torchao is imported (its import warns)
from torchtitan_glm.components.metrics import flops_per_token  # noqa: E402
from torchtitan_glm.config import load_config, main_guard  # noqa: E402
from torchtitan_glm.float8 import convert_float8, param_precisions  # noqa: E402
from torchtitan_glm.models.glm5 import Glm5Model  # noqa: E402
from torchtitan_glm.models.glm5.dsa import KPoolIndexer  # noqa: E402
from torchtitan_glm.train import build_model_args  # noqa: E402


def fp8_flop_share(model: torch.nn.Module, rows: list[dict[str, str]], seq_len: int) -> float:
    """Training FLOPs of the FP8 GEMMs over the trainer's FLOPs per token: 6 x (active FP8 weight elements per
    token); routed experts count top-k of E, as metrics.flops_breakdown does."""
    args = model.args
    params = dict(model.named_parameters())
    fp8 = 0.0
    for row in rows:
        if row["precision"].startswith("fp8"):
            n = params[row["fqn"]].numel()
            if row["role"] == "experts":
                n = n * args.num_experts_per_tok / args.n_routed_experts
            fp8 += 6 * n
    return fp8 / flops_per_token(args, seq_len)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        usage="%(prog)s [-h] [--json] [--config FILE.toml] [--section.key VALUE ...]", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="the remaining options are train.py's config keys (--config, --section.key VALUE); "
               "`python train.py --help` lists them")
    p.add_argument("--json", action="store_true", help='print a JSON list of {"fqn", "role", "precision"}')
    return p


def fp32_matmul_notes(model: torch.nn.Module, rows: list[dict[str, str]]) -> list[str]:
    """Lines for parameters whose row gives the weight's precision but whose matmul runs in FP32: the indexer's
    weights_proj under model.indexer_weights_fp32 (upcast to FP32 before its GEMM, dsa.KPoolIndexer.head_weights)."""
    precision = {r["fqn"]: r["precision"] for r in rows}
    fqns = [f"{p}.weights_proj.weight" for p, m in model.named_modules()
            if isinstance(m, KPoolIndexer) and m.weights_fp32]
    if not fqns:
        return []
    kinds = "/".join(sorted({precision[f].upper() for f in fqns}))
    return [f"indexer weights_proj ({len(fqns)} Linear): weights {kinds}, matmul in FP32 "
            "(model.indexer_weights_fp32 = true)"]


def report(argv: list[str]) -> tuple[list[dict[str, str]], float, str, list[str]]:
    """(rows, FP8 FLOP share, the float8 start-up line (as train.py prints it), notes on FP32 matmuls of non-FP32
    weights) for a config given as train.py arguments."""
    # The data section is irrelevant here; its files need not exist on the machine that asks.
    cfg = load_config([*argv, "--data.source=builtin", "--data.paths=", "--data.tokenizer=byte"])
    with torch.device("meta"):
        model = Glm5Model(build_model_args(cfg))
    summary = convert_float8(model, cfg=cfg.float8)
    rows = param_precisions(model, param_dtype=cfg.training.mixed_precision_param)
    return rows, fp8_flop_share(model, rows, cfg.training.seq_len), summary.line(), fp32_matmul_notes(model, rows)


@main_guard
def main(argv: list[str] | None = None) -> None:
    opts, rest = _parser().parse_known_args(list(sys.argv[1:] if argv is None else argv))
    rows, share, line, notes = report(rest)
    if opts.json:
        print(json.dumps(rows, indent=1))
        return
    width = max(len(r["fqn"]) for r in rows)
    for r in rows:
        print(f"{r['fqn']:<{width}}  {r['role']:<13}  {r['precision']}")
    print()
    for (role, precision), n in sorted(Counter((r["role"], r["precision"]) for r in rows).items()):
        print(f"{n:6d} x {role:<13} {precision}")
    print(line)
    for note in notes:
        print(note)
    print(f"share of training FLOPs in FP8: {100 * share:.1f}%")


if __name__ == "__main__":
    main()
