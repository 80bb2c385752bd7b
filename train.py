"""Entry point: `torchrun --nproc-per-node N train.py --config train_configs/debug_model.toml [--section.key value]`."""

from torchtitan_glm.train import main

if __name__ == "__main__":
    main()
