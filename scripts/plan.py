"""Plan a GLM-5.3-Flash training run on N GPUs: per-GPU memory (parameters, gradients, optimizer state, activations by
layer type), FLOPs per token, communication per collective, step time, tokens/s and MFU, for one layout or a search.

    python scripts/plan.py --config train_configs/glm5_3_flash.toml --gpus 64 [--gpu h200] [--json] \\
        [--search [--top 5] [--ac none,selective,full] [--local-batch 1,2]] [--what-if] \\
        [--scope train|bench_train|bench_reference] [--section.key value ...]

The layout is the config's [parallelism] with `--parallelism.<key> value` overrides (TorchTitan's keys:
data_parallel_replicate_degree, data_parallel_shard_degree, tensor_parallel_degree, context_parallel_degree,
expert_parallel_degree). A layout the trainer rejects exits 2 with the trainer's own message, unless --what-if (then
it is planned all the same and marked, e.g. ep not a multiple of cp); `--parallelism.expert_fsdp false` plans EP with
every rank's experts kept whole (the trainer's key, default true: rows sharded over the ranks holding them). --search
plans every layout of N GPUs the cost model describes, context parallelism included (with each --ac mode and
--local-batch) and ranks those that fit within 90% of the card by tokens/s. --scope bench_train / bench_reference
plans scripts/benchmark.py's training / reference scope on one device (the benchmark's default, one document per row
and no ids, is `--data.document_masking false`; its packed rows, `--docs N`, the default true). Every assumption is
printed with the plan (torchtitan_glm/planner/ says how each number is made).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchtitan_glm.components.logs import drop_benign_warnings  # noqa: E402

drop_benign_warnings()  # before the planner imports torchao, whose import warns
from torchtitan_glm.config import ConfigError, main_guard  # noqa: E402
from torchtitan_glm.planner import PlanError, Request, get_gpu, plan, search  # noqa: E402
from torchtitan_glm.planner.memory import SCOPES  # noqa: E402
from torchtitan_glm.planner.report import plan_text, search_json, search_text  # noqa: E402

_REGIMES = {"none": "compiled", "selective": "selective", "full": "full"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, required=True, help="GPUs of the run (the trainer's world size)")
    p.add_argument("--gpu", default="h200", help="GPU model (hardware.GPUS)")
    p.add_argument("--json", action="store_true", help="print the plan (or the search's top plans) as JSON")
    p.add_argument("--search", action="store_true", help="rank every layout of --gpus GPUs that fits")
    p.add_argument("--top", type=int, default=5, help="plans the search prints")
    p.add_argument("--ac", default=None, help="search: AC modes to try, comma-separated (default: the config's)")
    p.add_argument("--local-batch", default=None, help="search: local batch sizes to try (default: the config's)")
    p.add_argument("--what-if", action="store_true", help="plan layouts the trainer does not accept yet")
    p.add_argument("--scope", default="train", choices=SCOPES)
    return p


def run(argv: list[str]) -> str:
    """The script's output for `argv` (planner options and train.py's --config/--section.key arguments)."""
    opts, rest = _parser().parse_known_args(argv)
    if opts.gpus < 1:
        raise PlanError(f"--gpus must be >= 1, got {opts.gpus}")
    if opts.top < 1:
        raise PlanError(f"--top must be >= 1, got {opts.top}")
    request = Request(tuple(rest), opts.gpus, get_gpu(opts.gpu), opts.scope, opts.what_if)
    if opts.search:
        if opts.scope != "train":
            raise PlanError("--search plans train.py layouts (--scope train)")
        regimes = None
        if opts.ac:
            unknown = [m for m in opts.ac.split(",") if m not in _REGIMES]
            if unknown:
                raise PlanError(f"--ac: unknown mode(s) {unknown}; choose from {sorted(_REGIMES)}")
            regimes = tuple(_REGIMES[m] for m in opts.ac.split(","))
        try:
            batches = tuple(int(b) for b in opts.local_batch.split(",")) if opts.local_batch else None
        except ValueError:
            raise PlanError(f"--local-batch: comma-separated integers, got {opts.local_batch!r}") from None
        if batches is not None and min(batches) < 1:
            raise PlanError(f"--local-batch: each local batch must be >= 1, got {opts.local_batch!r}")
        result = search(request, top=opts.top, regimes=regimes, local_batches=batches)
        if opts.json:
            return json.dumps(search_json(result, gpus=opts.gpus, gpu_name=request.gpu.name), indent=1)
        return search_text(result, gpus=opts.gpus, gpu_name=request.gpu.name)
    p = plan(request)
    return json.dumps(p.to_json(), indent=1) if opts.json else plan_text(p)


@main_guard
def main(argv: list[str] | None = None) -> None:
    try:
        print(run(list(sys.argv[1:] if argv is None else argv)))
    except (PlanError, ValueError) as e:  # the trainer's layout errors (ParallelDims) and the planner's own
        if isinstance(e, ConfigError):
            raise
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
