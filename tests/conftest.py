"""Test-wide setup: quiet torchao's CUDA-extension loading on CPU machines before anything imports it."""

import os

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
