"""torchrun worker for test_planner_cp.py: the bytes autograd keeps per block on each rank of a context-parallel
run (the row zigzag over the whole world; eager; AC modes from argv), written as JSON to $PLANNER_OUT/rank<r>.json."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.unit.test_planner_activations import KINDS, SEQ, WIDTHS, _Capture
from torchtitan_glm.activation_checkpoint import wrap_block
from torchtitan_glm.components.loss import indexer_kl_loss
from torchtitan_glm.distributed.cp_layout import CPLayout
from torchtitan_glm.models.glm5 import Glm5Model, get_flavor
from torchtitan_glm.models.glm5.batch import train_batch


def measure(ac: str, kl: str, group, rank: int, world: int) -> dict[str, int]:
    args = get_flavor("debug").replace(**WIDTHS)
    torch.manual_seed(0)
    model = Glm5Model(args).to(torch.bfloat16)
    ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sinks: dict[str, dict[int, int]] = {name: {} for name in KINDS}
    for name in KINDS:
        parent, _, attr = name.rpartition(".")
        holder = model.get_submodule(parent) if parent else model
        block = wrap_block(holder[attr] if parent else getattr(holder, attr), mode=ac)
        wrapped = _Capture(block, ptrs, sinks[name])
        if parent:
            holder[attr] = wrapped
        else:
            setattr(holder, attr, wrapped)
    tokens = torch.randint(0, args.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(tokens, -1, 1)
    labels[:, -1] = -100
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
