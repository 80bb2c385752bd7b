"""torchrun worker of tests/distributed/test_checkpoint.py: CheckpointManager with FSDP2 on a 2-rank CPU (gloo) mesh.

    _ckpt_worker.py MODE DUMP_FOLDER OUT_DIR [ASYNC_MODE]
MODE: first   train 3 steps, save step 3, draw RNGs, train 2 more; write losses/draws to OUT_DIR/first_rank{r}.json
      resume  fresh objects (other init), load (must be step 3), draw RNGs, train 2; write OUT_DIR/resume_rank{r}.json
      crash   save step 1 of a ~4 MB model, store its local shards, print "SAVE2_STARTED rank{r} pid={pid}",
              then save step 2 with a storage writer that sleeps before every tensor (the parent SIGKILLs the
              workers mid-write)
      verify  after the crash: load must pick step 1 with the stored shards; a new save of step 2 then succeeds
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from torchtitan_glm.config import CheckpointConfig
from torchtitan_glm.components.checkpoint import CheckpointManager, list_checkpoints
from torchtitan_glm.components.errors import exit_now


def _Cfg(**overrides) -> CheckpointConfig:  # noqa: N802 - reads like the dataclass it builds
    """The real [checkpoint] section, enabled and saving every step unless overridden."""
    return CheckpointConfig(**{"enable": True, "interval": 1, **overrides})


class _Loader:
    """Stateful fake data with the trainer loader's contract: one global position, the same on every rank (saved
    once); rank r's batch at position p is a function of (p, r)."""

    def __init__(self, rank: int, width: int) -> None:
        self.width, self.rank, self.pos = width, rank, 0

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * self.rank + self.pos)
        self.pos += 1
        return torch.randn(8, self.width, generator=g), torch.randn(8, 4, generator=g)

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


class _SlowWriter(FileSystemWriter):
    """Writes each tensor 0.25 s after the previous one, so a save stays mid-write for seconds."""

    def write_data(self, plan, planner):
        resolve = planner.resolve_data

        def slow_resolve(item):
            time.sleep(0.25)
            return resolve(item)

        planner.resolve_data = slow_resolve
        return super().write_data(plan, planner)


class _CrashableManager(CheckpointManager):
    slow = False

    def _storage_writer(self, path: str):
        return _SlowWriter(path) if self.slow else super()._storage_writer(path)


def _build(seed: int, mesh, rank: int, *, width: int, depth: int, cfg: CheckpointConfig, dump: str):
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU(), nn.Dropout(0.1)]
    model = nn.Sequential(*layers, nn.Linear(width, 4))
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
    loader = _Loader(rank, width)
    mgr = _CrashableManager(cfg=cfg, dump_folder=dump, model=model, optimizer=opt, lr_scheduler=sched,
                            dataloader=loader)
    # Per-rank RNG streams that differ between ranks and between runs (the checkpoint must restore each rank's).
    torch.manual_seed(seed * 100 + rank)
    random.seed(seed * 100 + rank)
    np.random.seed(seed * 100 + rank)
    return model, opt, sched, loader, mgr


def _train(model, opt, sched, loader, n: int) -> list[float]:
    """Steps whose losses depend on every RNG the manager restores (torch, python and numpy)."""
    losses = []
    for _ in range(n):
        x, y = next(loader)
        jitter = 1.0 + 1e-3 * random.random() + 1e-3 * float(np.random.rand())
        loss = nn.functional.mse_loss(model(x), y) * jitter
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _draws() -> list:
    return [torch.rand(3).tolist(), random.random(), float(np.random.rand())]


def _local_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def main() -> None:
    mode, dump, out = sys.argv[1], sys.argv[2], sys.argv[3]
    async_mode = sys.argv[4] if len(sys.argv) > 4 else "disabled"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    cfg = _Cfg(async_mode=async_mode)
    result: dict = {"rank": rank}
    if mode in ("first", "resume"):
        model, opt, sched, loader, mgr = _build(0 if mode == "first" else 1, mesh, rank, width=16, depth=2,
                                                cfg=cfg, dump=dump)
        if mode == "first":
            _train(model, opt, sched, loader, 3)
            assert mgr.save(3)
            result["published_before_wait"] = os.path.isdir(os.path.join(dump, "checkpoint", "step-3"))
        else:
            result["loaded"] = mgr.load()
            result["pos"], result["last_epoch"] = loader.pos, sched.last_epoch
        result["draws"] = _draws()
        result["losses"] = _train(model, opt, sched, loader, 2)
        mgr.close()
        result["checkpoints"] = list_checkpoints(os.path.join(dump, "checkpoint"))
    elif mode == "crash":
        model, opt, sched, loader, mgr = _build(0, mesh, rank, width=512, depth=4, cfg=cfg, dump=dump)
        _train(model, opt, sched, loader, 1)
        assert mgr.save(1)
        torch.save(_local_shards(model), os.path.join(out, f"ref_rank{rank}.pt"))
        _train(model, opt, sched, loader, 1)
        dist.barrier()
        mgr.slow = True
        print(f"\nSAVE2_STARTED rank{rank} pid={os.getpid()}", flush=True)
        mgr.save(2)
        print(f"SAVE2_DONE rank{rank}", flush=True)  # the parent fails the test if the kill came this late
    elif mode == "verify":
        model, opt, sched, loader, mgr = _build(1, mesh, rank, width=512, depth=4, cfg=cfg, dump=dump)
        result["loaded"] = mgr.load()
        ref = torch.load(os.path.join(out, f"ref_rank{rank}.pt"))
        got = _local_shards(model)
        result["shards_equal"] = sorted(ref) == sorted(got) and all(torch.equal(ref[k], got[k]) for k in ref)
        result["pos"] = loader.pos
        _train(model, opt, sched, loader, 1)
        assert mgr.save(2)
        mgr.close()
        root = os.path.join(dump, "checkpoint")
        result["checkpoints"] = list_checkpoints(root)
        result["entries"] = sorted(os.listdir(root))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    with open(os.path.join(out, f"{mode}_rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now(0)  # no interpreter teardown after the process group is gone (see exit_now)
