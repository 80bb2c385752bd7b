"""training.device_memory_limit_gib on the GPU: the trainer caps its process, so an allocation past the limit fails
as an out-of-memory error would (after the allocator has released its cache), and one within it succeeds."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_host_syncs import _trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_trainer_caps_the_process_at_the_limit(tmp_path, world_of_one):
    gib = 2**30
    torch.cuda.empty_cache()  # the reserve counts blocks cached by earlier tests in this process (4.8 GiB on 12-07)
    try:
        trainer = _trainer(tmp_path, "--training.device_memory_limit_gib", "6")
        assert trainer.device.type == "cuda"
        held = torch.cuda.memory_reserved(trainer.device)
        within = torch.empty(5 * gib - held - gib // 2, dtype=torch.uint8, device=trainer.device)
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 * gib, dtype=torch.uint8, device=trainer.device)
        assert torch.cuda.memory_reserved(trainer.device) <= 6 * gib
        del within
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
