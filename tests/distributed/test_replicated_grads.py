"""The gradients of the parameters kept out of FSDP2 (FP32-kept maps, gates and norms), averaged by bucketed
all-reduces launched during backward, equal a single process's on the whole batch (2 gloo ranks; AVG and the
SUM + multiply fallback), and the comparison fails for a sum (_replicated_grads_worker.py); and the 2-rank training
loop, those all-reduces included, reads nothing from the device (_host_syncs_worker.py)."""

from .test_train import run_worker_ok


def test_replicated_gradients_equal_one_process_and_overlap_backward():
    run_worker_ok("_replicated_grads_worker.py")


def test_two_rank_training_loop_reads_nothing_from_the_device(tmp_path):
    """The host-sync count of tests/unit/test_host_syncs.py on 2 ranks, where the replicated gradients' bucketed
    all-reduce runs (on one rank it never launches)."""
    run_worker_ok("_host_syncs_worker.py", args=[str(tmp_path)])
