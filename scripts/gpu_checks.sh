#!/usr/bin/env bash
# One GPU session: the CUDA tests (FLA KDA vs the torch reference), the proxy benchmark (eager vs compiled,
# with and without AC) and a short GPU training run (NCCL, BF16 mixed precision, inductor). Logs go to $OUT.
# Usage (on the GPU machine, FLA/torchao installed): OUT=./gpu_out bash scripts/gpu_checks.sh
set -uo pipefail
OUT=${OUT:-./gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1
nvidia-smi -L | tee "$OUT/device.txt"
python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)" | tee -a "$OUT/device.txt"
timeout "${GPU_TEST_TIMEOUT:-200}" python3 -m pytest -q -m gpu tests/gpu -x -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
timeout "${BENCH_TIMEOUT:-270}" python3 scripts/benchmark.py --flavor glm5_3_flash_proxy --seq-len 4096 --steps 3 --warmup 1 \
    --runs "${BENCH_RUNS:-eager:none,compiled:none,eager:full,compiled:full}" --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
timeout "${TRAIN_TIMEOUT:-90}" torchrun --nproc-per-node 1 train.py --config train_configs/debug_model.toml \
    --training.mixed_precision_param bfloat16 --compile.enable true --compile.backend inductor --training.steps 10 \
    --metrics.log_freq 2 --checkpoint.enable false --job.dump_folder "$OUT/train" 2>&1 | tee "$OUT/train.log"
