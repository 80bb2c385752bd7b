"""Runs shared by the torchrun tests of this folder."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """The uninterrupted SHORT job of test_train.py (20 steps, checkpoints at 10 and 20, TensorBoard in tb/): its
    dump folder and console losses. Tests read it and copy what they change."""
    from tests.distributed.test_train import SHORT, _losses, _run_ok

    dump = tmp_path_factory.mktemp("reference")
    return dump, _losses(_run_ok(SHORT + [f"--job.dump_folder={dump}"]).stdout)
