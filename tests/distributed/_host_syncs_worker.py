"""torchrun worker of test_replicated_grads.py::test_two_rank_training_loop_reads_nothing_from_the_device (2 gloo
ranks): the debug model's training loop with fused AdamW reads nothing from the device on either rank, the
replicated parameters' bucketed gradient all-reduce included (one rank never launches it).
usage: _host_syncs_worker.py DUMP_FOLDER"""

import sys

import torch.distributed as dist

from tests.host_syncs import SyncRecorder
from torchtitan_glm.config import load_config
from torchtitan_glm.train import Trainer


def main() -> None:
    cfg = load_config(["--config", "train_configs/debug_model.toml", "--training.seq_len", "32",
                       "--training.local_batch_size", "1", "--training.steps", "4", "--metrics.log_freq", "2",
                       "--optimizer.implementation", "fused", "--checkpoint.enable", "false",
                       "--metrics.enable_tensorboard", "false", "--lr_scheduler.warmup_steps", "1",
                       f"--job.dump_folder={sys.argv[1]}"])
    trainer = Trainer(cfg)
    rank = dist.get_rank()
    replicated = trainer.replicated
    assert replicated is not None and replicated.buckets, "no replicated gradients to all-reduce on 2 ranks"
    launched = []
    for bucket in replicated.buckets:  # count the all-reduces, so the loop is known to have run them
        original = bucket.launch

        def launch(original=original):
            launched.append(1)
            original()

        bucket.launch = launch
    with SyncRecorder(step=lambda: trainer.step) as rec:
        losses = trainer.train()
    assert len(losses) == 4
    assert len(launched) == 4 * len(replicated.buckets), (len(launched), len(replicated.buckets))
    syncs = "\n".join(f"step {s.step}: {s.what} at {s.where}" for s in rec.syncs)
    assert not rec.syncs, f"rank {rank}: host syncs in the training loop:\n{syncs}"
    trainer.close()
    print(f"rank {rank} OK", flush=True)


if __name__ == "__main__":
    main()
