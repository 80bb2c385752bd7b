"""torchrun worker for test_planner_cp.py: the bytes autograd keeps per block on each rank of a context-parallel
run (the row zigzag over the whole world; eager; AC modes from argv), written as JSON to $PLANNER_OUT/rank<r>.json."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.unit.test_planner_activations import SEQ, captured_model
from torchtitan_glm.components.loss import indexer_kl_loss
from torchtitan_glm.distributed.cp_layout import CPLayout
from torchtitan_glm.models.glm5.batch import train_batch
from torchtitan_glm.components.errors import exit_now


def measure(ac: str, kl: str, group, rank: int, world: int) -> dict[str, int]:
    model, sinks, tokens, labels = captured_model("eager", ac)
    batch = train_batch(tokens, labels, torch.zeros_like(tokens), cp=(group, CPLayout(size=world, rank=rank)))
    out = model(batch, token_scale=1.0 / SEQ, mtp_scale=0.1 / SEQ, indexer_kl=kl)
    (out.loss + indexer_kl_loss(out.indexer_stats, group=group)).backward()
    return {name: sum(s.values()) for name, s in sinks.items()}


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = {}
    for spec in sys.argv[1].split(","):
        ac, kl = spec.split(":")
        runs[spec] = measure(ac, kl, dist.group.WORLD, rank, world)
    Path(os.environ["PLANNER_OUT"], f"rank{rank}.json").write_text(json.dumps(runs))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now(0)  # no interpreter teardown after the process group is gone (see exit_now)
