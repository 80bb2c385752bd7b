"""torchrun worker for test_planner_state.py: the trainer takes one step on the debug model; in the optimizer's
post-step hook (gradients still there) each rank records the bytes it holds, for every config given as a
';'-separated list of train.py argument strings, into $PLANNER_OUT/rank<r>.json."""

import json
import os
import sys

import torch
from torch.distributed.tensor import DTensor

from torchtitan_glm.config import load_config
from torchtitan_glm.train import Trainer
from torchtitan_glm.components.errors import exit_now


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors: their local shard's storage)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        local = t._local_tensor if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def held(trainer: Trainer, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = list(trainer.model.parameters())
    return {
        "params": _storage_bytes(params),
        "grads": _storage_bytes(p.grad for p in params),
        "optimizer": _storage_bytes(v for state in optimizer.state.values() for v in state.values()),
        "replicated_params": _storage_bytes(trainer.replicated.params),  # what parallelize.py keeps out of FSDP2
    }


def main() -> None:
    out_dir = os.environ["PLANNER_OUT"]
    results = []
    trainer = None
    for arg_string in sys.argv[1].split(";"):
        cfg = load_config(arg_string.split() + ["--checkpoint.enable=false", "--metrics.enable_tensorboard=false"])
        trainer = Trainer(cfg)
        record: dict[str, int] = {}
        trainer.optimizer.register_step_post_hook(
            lambda opt, args, kwargs, t=trainer, r=record: r.update(held(t, opt)))
        trainer.train_step(next(trainer.dataloader))
        assert record, "the optimizer step hook did not run"
        results.append(record)
    with open(os.path.join(out_dir, f"rank{trainer.rank}.json"), "w") as f:
        json.dump(results, f)
    trainer.close()


if __name__ == "__main__":
    exit_now(main() or 0)  # no interpreter teardown after the process group is gone (see exit_now)
