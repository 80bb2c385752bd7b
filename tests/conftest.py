"""Test-wide setup: quiet torchao's CUDA-extension loading on CPU machines before anything imports it; without CUDA,
hide FLA from transformers (its Triton KDA kernels cannot run on CPU tensors, and transformers picks them whenever
`fla` imports, e.g. on a CPU machine that has triton installed) so the reference takes its torch path."""

import os
import sys

import torch

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
if not torch.cuda.is_available():
    sys.modules.setdefault("fla", None)
