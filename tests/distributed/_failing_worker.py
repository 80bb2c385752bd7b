"""torchrun worker of tests/distributed/test_reliability.py: train.py, except that one rank raises at the start of
one step. The failure is patched in here, in a test-only script, so no user setting can trip it.

    TTG_FAIL_RANK=1 TTG_FAIL_STEP=3 TTG_FAIL_KIND=expected|unexpected torchrun ... _failing_worker.py --config ...
expected: a DataError (reported as one line); unexpected: a RuntimeError (reported with its traceback).
"""

from __future__ import annotations

import os
import sys

from torchtitan_glm import train
from torchtitan_glm.components.errors import exit_now


def main() -> None:
    rank, step, kind = int(os.environ["TTG_FAIL_RANK"]), int(os.environ["TTG_FAIL_STEP"]), os.environ["TTG_FAIL_KIND"]
    original = train.Trainer.train_step

    def train_step(self, *args, **kwargs):
        if self.rank == rank and self.step == step:
            if kind == "expected":
                from torchtitan_glm.components.errors import DataError

                raise DataError(f"injected: rank {rank} cannot use its batch at step {step}")
            raise RuntimeError(f"injected: rank {rank} crashed at step {step}")
        return original(self, *args, **kwargs)

    train.Trainer.train_step = train_step
    train.main(sys.argv[1:])


if __name__ == "__main__":
    main()
    exit_now(0)  # a rank whose run ended normally: no interpreter teardown (see exit_now)
