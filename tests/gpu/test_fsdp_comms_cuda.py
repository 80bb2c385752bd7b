"""parallelism.fsdp_reduce_in_compute_pool on a GPU, where the streams are real: the reduce output is written on
FSDP2's reduce-scatter stream into a block of the compute stream's pool, so a wrong ordering would show as
gradients that differ from the default's. The CPU counterpart is tests/unit/test_fsdp_comms.py."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_fsdp_comms import _train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("accumulate", [(), ("--training.global_batch_size", "2",
                                              "--parallelism.fsdp_reshard_after_forward", "never")],
                         ids=["one_batch", "two_microbatches"])
def test_training_is_identical_with_the_reduce_in_the_compute_pool_on_cuda(tmp_path, world_of_one, monkeypatch,
                                                                          accumulate):
    det = ("--training.deterministic", "true")  # bit-identical runs on CUDA (no atomics' ordering in between)
    off = _train(tmp_path / "off", monkeypatch, *accumulate, *det, "--parallelism.fsdp_reduce_in_compute_pool", "false")
    assert off[2] is None  # the default is on here: the baseline must turn it off
    on = _train(tmp_path / "on", monkeypatch, *accumulate, *det, "--parallelism.fsdp_reduce_in_compute_pool", "true")
    assert on[2] is not None and on[2].stream is not None and on[2].allocated > 0
    assert on[0] == off[0]
    for name, p in off[1].items():
        assert torch.equal(on[1][name], p), name
