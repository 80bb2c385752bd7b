"""train.py's allocator default: expandable segments unless the user set either allocator variable; and the
device memory limit (training.device_memory_limit_gib), refused where it cannot apply. (Applied on a GPU:
tests/gpu/test_cuda_alloc_cuda.py.)"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_glm.components.cuda_alloc import DEFAULT_ALLOC_CONF, default_alloc_conf, memory_limit_error

REPO = Path(__file__).resolve().parents[2]


def test_sets_expandable_segments_when_unset():
    env = {}
    assert "trainer's default" in default_alloc_conf(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": DEFAULT_ALLOC_CONF}


def test_leaves_the_users_setting_alone():
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        env = {name: "max_split_size_mb:512"}
        assert default_alloc_conf(env) == f"{name}=max_split_size_mb:512"
        assert env == {name: "max_split_size_mb:512"}


def test_memory_limit_is_checked_against_the_card():
    gib = 2**30
    assert memory_limit_error(110, total_bytes=140 * gib) is None
    assert memory_limit_error(140, total_bytes=140 * gib) is None
    assert memory_limit_error(150, total_bytes=140 * gib) == "is 150 GiB and the device has 140.0 GiB"
    assert "no CUDA device" in memory_limit_error(1, total_bytes=None)


@pytest.mark.parametrize("value,message", [("-1", "must be a finite number >= 0"), ("nan", "must be a finite number"),
                                           ("8", "no CUDA device")])
def test_train_refuses_a_bad_or_inapplicable_limit_naming_the_key(value, message, tmp_path):
    """A negative or non-finite limit, or any limit on a host without CUDA (this one), exits 2 before training,
    naming the key and writing nothing."""
    proc = subprocess.run([sys.executable, "train.py", "--config", "train_configs/debug_model.toml",
                           "--training.device_memory_limit_gib", value, f"--job.dump_folder={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2, proc.stderr
    assert "training.device_memory_limit_gib" in proc.stderr and message in proc.stderr
    assert not (tmp_path / "run").exists()
