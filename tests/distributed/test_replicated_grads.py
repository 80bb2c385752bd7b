"""The gradients of the parameters kept out of FSDP2 (FP32-kept maps, gates and norms), averaged by bucketed
all-reduces launched during backward, equal a single process's on the whole batch (2 gloo ranks; AVG and the
SUM + multiply fallback), and the comparison fails for a sum (_replicated_grads_worker.py)."""

from .test_train import run_worker_ok


def test_replicated_gradients_equal_one_process_and_overlap_backward():
    run_worker_ok("_replicated_grads_worker.py")
