"""train.py under a per-process CUDA memory cap: does a run fit a budget (or a smaller card) at all, and at what
speed, when the caching allocator has to give cached blocks back to stay under it?

    torchrun --nproc-per-node 1 scripts/train_capped.py --cap-gib 110 --config train_configs/glm5_3_flash_proxy.toml \\
        --training.global_batch_size 8 --parallelism.fsdp_reshard_after_forward never

torch.cuda.set_per_process_memory_fraction makes an allocation past the cap fail as an out-of-memory would, so the
allocator first releases what it has cached and retries; the run's reserved peak stays under the cap. The other
arguments are train.py's.
"""

from __future__ import annotations

import os
import runpy
import sys

import torch

from torchtitan_glm.components.cuda_alloc import default_alloc_conf


def _usage(message: str) -> None:
    print(f"train_capped.py: {message}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    args = sys.argv[1:]
    if args and args[0].startswith("--cap-gib="):
        args = ["--cap-gib", args[0].split("=", 1)[1], *args[1:]]
    if len(args) < 2 or args[0] != "--cap-gib":
        _usage("usage: scripts/train_capped.py --cap-gib GIB <train.py arguments>")
    try:
        cap = float(args[1]) * 2**30
    except ValueError:
        _usage(f"--cap-gib: not a number: {args[1]!r}")
    # train.py's allocator setting (expandable segments unless set), before the calls below start CUDA: the
    # allocator reads it once, and a capped run is only comparable with the trainer's runs under the same one
    default_alloc_conf()
    if not torch.cuda.is_available():
        _usage("--cap-gib caps CUDA memory: needs CUDA and none is visible")
    device = int(os.environ.get("LOCAL_RANK", 0))
    total = torch.cuda.get_device_properties(device).total_memory
    if not 0 < cap <= total:
        _usage(f"--cap-gib {args[1]}: the device has {total / 2**30:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    train = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "train.py")
    sys.argv = [train] + args[2:]
    runpy.run_path(train, run_name="__main__")


if __name__ == "__main__":
    main()
