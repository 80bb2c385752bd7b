"""training.global_batch_size over 2 gloo ranks: accumulated microbatches equal one batch of their rows
(_accumulation_worker.py); the one-rank case is tests/unit/test_grad_accumulation.py."""

import pytest

from .test_train import run_worker_ok


@pytest.mark.long
def test_accumulated_microbatches_equal_one_batch_on_two_ranks():
    run_worker_ok("_accumulation_worker.py")
