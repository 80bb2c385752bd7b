"""Entry point: `torchrun --nproc-per-node N train.py --config train_configs/debug_model.toml [--section.key value]`."""

from torchtitan_glm.components.errors import exit_now
from torchtitan_glm.train import main

if __name__ == "__main__":
    main()
    exit_now(0)  # the run finished, wrote its outputs and released the process group: skip interpreter teardown
