#!/usr/bin/env bash
# One GPU session: the CUDA tests (FLA KDA vs the torch reference), the proxy benchmark (eager vs compiled,
# with and without AC) and a short GPU training run (NCCL, BF16 mixed precision, inductor). Logs go to $OUT.
#   OUT=./gpu_out bash scripts/gpu_checks.sh            (on the GPU machine, FLA/torchao importable)
#   STAGES="tests" / "bench" / "fp8" / "train" select parts; *_TIMEOUT bound each part. tests: GPU_TESTS (default
#   tests/gpu: more than one 600-s call holds, so name files or test ids; split on spaces, so no quoted -k).
#   fp8: the CUDA FP8 tests, scripts/precision_agreement.py on the proxy, and BF16 vs FP8-split benchmark runs
#   (FP8_RUNS, FP8_SEQ, FP8_SCOPE; alone: fp8bench).
#   longctx: the Triton sparse-MLA tests, scripts/bench_dsa.py (DSA_SEQ; alone: dsa) and the proxy's sequence-length
#   sweep with the sparse indexer KL (SWEEP_SEQ, SWEEP_RUNS, SWEEP_KL, SWEEP_MOE_CHUNK, SWEEP_OFFLOAD=1 for the full-AC
#   blocks' inputs in host memory; alone: sweep; one compile per T, so split long compiled sweeps across calls;
#   HOST_SAMPLER=<seconds> logs host memory meanwhile).
#   speed (issue 12): scripts/bench_kda.py (KDA_SEQ, KDA_PROFILE=1 for its kernel tables; alone: kda),
#   scripts/bench_causal_conv.py (the short conv's kernels against FLA's at KDA_SEQ, CONV_DOCS documents; alone: conv),
#   scripts/bench_mhc.py (MHC_SEQ; alone: mhc), scripts/benchmark.py --against transformers (AGAINST_SEQ,
#   AGAINST_RUNS; needs transformers >= 5.23 importable; alone: against). proxytrain: train.py on train_configs/glm5_3_flash_proxy.toml (PROXY_STEPS, PROXY_ARGS).
#   serving: the CUDA decode tests (FLA recurrent KDA, prefill states, sparse MLA over the latent cache, debug model
#   decode == forward), scripts/rollout_agreement.py on the proxy (ROLLOUT_PRECISIONS; on the proxy trained
#   ROLLOUT_TRAIN_STEPS=30 steps first, 0 = random weights, or ROLLOUT_SOURCE="--hf DIR"/"--checkpoint DIR") and
#   scripts/bench_decode.py.
#   agreement (issue 8): scripts/precision_agreement.py on the proxy trained as for serving (the same folder, trained
#   once per warm machine).
#   recompute (issue 12 item 4): the training-scope benchmark, compiled, once per recompute_modules choice in
#   RECOMPUTE_RUNS (default: selective AC alone, then +kda) at RECOMPUTE_SEQ (16384); about 3 minutes of compile
#   per run on an H100, so split longer lists across calls.
#   probe: scripts/probe_layers.py, each layer's output eager against compiled (PROBE_SEQ, default 16384; PROBE_ARGS),
#   written for the compiled-only loss fault at 16K (docs/performance.md, twenty-seventh session; found with it and
#   fixed in the twenty-eighth: inductor's int32 offsets in the fused CE).
#   optimbench (issue 12): scripts/bench_optim.py, the optimizer step alone over the proxy's parameters
#   (OPTIMBENCH_ARGS, e.g. "--max-elements 2e9" on an 80 GB card).
#   fp8curve (issue 8): 200 proxy steps through train.py, BF16 and the FP8 split (FP8CURVE_PREC, one per call),
#   compared by scripts/compare_runs.py (end means within 1%).
#   optim (issue 12): train.py on the proxy, eager (no compile to pay), for each name[:implementation] in OPTIM_NAMES
#   (default AdamW8bit:fused AdamW8bit:compiled AdamWFp8:fused AdamW), OPTIM_STEPS steps with [profiling] on the
#   last two: the optimizer step's device time (ops.txt, row Optimizer.step#<name>.step) and the peak memory per optimizer (full AC: AdamW's FP32 moments alone
#   take 59 GiB).
#   accum (issue 12): the training-scope benchmark and train.py on the proxy in one call, train.py at each global batch
#   in ACCUM_GLOBAL_LIST (default "1 8" rows: one row per step, and 8 microbatches accumulated) under
#   fsdp_reshard_after_forward ACCUM_RESHARD (default never) and AC mode ACCUM_AC (default selective; none fits at 8
#   rows per step by plan); ACCUM_BENCH=0 leaves the benchmark out; ACCUM_ARGS: more train.py overrides (e.g.
#   "--optimizer.implementation fused").
#   multigpu (issue 15; needs a multi-GPU kind): train.py on the proxy with FSDP2 x EP over N GPUs for each N in
#   MULTI_N (default 1 2 4 8, up to the GPUs present), FP8 split on, MULTI_STEPS steps, one log per N (tokens/s,
#   MFU, peak memory per GPU in its metric lines; weak scaling = tokens/s per GPU at N / at 1); then CP = 2 x EP on
#   T = MULTI_CP_SEQ (32768). NVLink multicast stays off (NCCL_NVLS_ENABLE=0), as the device README asks.
# FLA autotunes every Triton kernel per shape on a fresh machine (minutes per shape) and keeps the result in
# the Triton cache (*.autotune.json). The caches live under .gpu_cache/live (git ignores it; a warm device machine
# keeps it between calls). At the end the autotune results alone are packed into $OUT/fla_autotune.tgz (KBs; the
# whole caches are tens of MB, over what comes back from the device): put it at .gpu_cache/fla_autotune.tgz, or
# refresh scripts/gpu_cache/fla_autotune_h200.tgz with it, to start a fresh machine without autotuning.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu_out}
STAGES=${STAGES:-"tests bench train"}
CACHE=${CACHE:-$PWD/.gpu_cache/live}
mkdir -p "$OUT" "$CACHE/triton" "$CACHE/inductor"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1
export TRITON_CACHE_DIR=$CACHE/triton TORCHINDUCTOR_CACHE_DIR=$CACHE/inductor
# Seed: .gpu_cache/fla_autotune.tgz if present, else the tracked results measured on an H200 with torch 2.11,
# triton 3.6, FLA 0.6 for the proxy and debug shapes, plus those of the first GPU tests (kda_fla, decode prefill),
# measured on an H100 (sm_90 too; 2026-12-08: 39 entries, 115 in all). Triton keys them by kernel source and
# version, so with other versions they are simply not found.
if [ -z "$(ls -A "$CACHE/triton")" ]; then
  seed=scripts/gpu_cache/fla_autotune_h200.tgz
  [ -f .gpu_cache/fla_autotune.tgz ] && seed=.gpu_cache/fla_autotune.tgz
  tar xzf "$seed" -C "$CACHE/triton"
fi
# the autotune results so far, packed after every stage: a call cut short by its time limit still returns them
pack_cache() { (cd "$CACHE/triton" && find . -name '*.autotune.json' | tar czf "$OUT/fla_autotune.tgz" -T -); }
# HOST_SAMPLER=3: host memory every 3 s into $OUT/host_mem.log (used and available GiB, the largest process's RSS in
# KiB): the compiled 128K offload run was killed by the host's OOM killer (docs/performance.md, eighth session)
sampler=""
if [ -n "${HOST_SAMPLER:-}" ]; then
  (while :; do echo "$(date +%T) used/avail GiB $(free -g | awk 'NR==2{print $3, $7}') top RSS KiB" \
      "$(ps -eo rss,comm --sort=-rss | sed -n 2p)"; sleep "$HOST_SAMPLER"; done) > "$OUT/host_mem.log" 2>&1 &
  sampler=$!
fi
trap 'pack_cache; [ -n "$sampler" ] && kill "$sampler"' EXIT
# the GPU tests: at GPU_TEST_TIMEOUT pytest gets SIGINT, so it still prints the failures so far (-rfE: their
# messages in the short summary); a plain kill returned only the progress dots (2026-12-07). A test inside FLA's
# autotuning ignored the SIGINT and was killed 20 s later with no summary (2026-12-08), so each test's id and outcome
# (-v) and what it prints (-s: the two sides of each tolerance comparison, to calibrate the bars against) are
# written as they happen
gpu_pytest() {
  local log=$1; shift
  timeout -s INT -k 20 "${GPU_TEST_TIMEOUT:-300}" python3 -m pytest -v -s -rfE -m gpu "$@" -p no:cacheprovider 2>&1 \
      | tee "$log"
}
nvidia-smi -L | tee "$OUT/device.txt"
python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)" | tee -a "$OUT/device.txt"
case " $STAGES " in *" tests "*)
  gpu_pytest "$OUT/gpu_tests.log" ${GPU_TESTS:-tests/gpu} ;;
esac
pack_cache
case " $STAGES " in *" bench "*)
  timeout "${BENCH_TIMEOUT:-300}" python3 scripts/benchmark.py --flavor glm5_3_flash_proxy --seq-len 4096 --steps 5 \
      --warmup 2 --runs "${BENCH_RUNS:-eager:none,compiled:none,eager:full,compiled:full}" --out "$OUT/bench.json" \
      2>&1 | tee "$OUT/bench.log" ;;
esac
pack_cache
case " $STAGES " in *" fp8 "*)
  gpu_pytest "$OUT/fp8_tests.log" tests/gpu/test_float8_cuda.py
  timeout 200 python3 scripts/precision_agreement.py --seq-len 4096 --json "$OUT/agreement.json" 2>&1 \
      | tee "$OUT/agreement.log" ;;
esac
case " $STAGES " in *" fp8 "*|*" fp8bench "*)
  timeout "${BENCH_TIMEOUT:-400}" python3 scripts/benchmark.py --flavor glm5_3_flash_proxy --seq-len "${FP8_SEQ:-4096}" \
      --steps 4 --warmup 2 --runs "${FP8_RUNS:-compiled:selective,compiled:selective:fp8}" --scope "${FP8_SCOPE:-train}" \
      --out "$OUT/bench_fp8.json" 2>&1 | tee "$OUT/bench_fp8.log" ;;
esac
case " $STAGES " in *" probe "*)
  timeout "${PROBE_TIMEOUT:-540}" python3 scripts/probe_layers.py --flavor glm5_3_flash_proxy \
      --seq-len "${PROBE_SEQ:-16384}" ${PROBE_ARGS:-} --json "$OUT/probe_layers.json" 2>&1 | tee "$OUT/probe_layers.log" ;;
esac
case " $STAGES " in *" recompute "*)
  timeout "${RECOMPUTE_TIMEOUT:-560}" python3 scripts/benchmark.py --flavor glm5_3_flash_proxy \
      --seq-len "${RECOMPUTE_SEQ:-16384}" --steps 3 --warmup 1 --scope train \
      --runs "${RECOMPUTE_RUNS:-compiled:selective,compiled:selective+kda}" \
      --out "$OUT/bench_recompute.json" 2>&1 | tee "$OUT/bench_recompute.log" ;;
esac
pack_cache
case " $STAGES " in *" longctx "*)
  gpu_pytest "$OUT/sparse_mla_tests.log" tests/gpu/test_sparse_mla.py ;;
esac
pack_cache
case " $STAGES " in *" longctx "*|*" dsa "*)
  timeout "${DSA_BENCH_TIMEOUT:-300}" python3 scripts/bench_dsa.py --seq-len "${DSA_SEQ:-8192,32768}" --layer 2>&1 \
      | tee "$OUT/bench_dsa.log" ;;
esac
pack_cache
case " $STAGES " in *" longctx "*|*" sweep "*)
  timeout "${SWEEP_TIMEOUT:-540}" python3 scripts/benchmark.py --flavor glm5_3_flash_proxy --seq-len "${SWEEP_SEQ:-sweep}" \
      --steps "${SWEEP_STEPS:-3}" --warmup 1 --docs 3 --runs "${SWEEP_RUNS:-compiled:auto}" --indexer-kl "${SWEEP_KL:-sparse}" \
      --moe-chunk-tokens "${SWEEP_MOE_CHUNK:-16384}" ${SWEEP_OFFLOAD:+--offload-inputs} --out "$OUT/sweep.json" 2>&1 \
      | tee "$OUT/sweep.log" ;;
esac
pack_cache
case " $STAGES " in *" speed "*|*" kda "*)
  timeout "${KDA_BENCH_TIMEOUT:-200}" python3 scripts/bench_kda.py --seq-len "${KDA_SEQ:-8192}" \
      ${KDA_PROFILE:+--profile} --json "$OUT/bench_kda.json" 2>&1 | tee "$OUT/bench_kda.log" ;;
esac
case " $STAGES " in *" speed "*|*" conv "*)
  timeout "${CONV_BENCH_TIMEOUT:-120}" python3 scripts/bench_causal_conv.py --seq-len "${KDA_SEQ:-8192}" \
      --docs "${CONV_DOCS:-0}" --json "$OUT/bench_conv.json" 2>&1 | tee "$OUT/bench_conv.log" ;;
esac
case " $STAGES " in *" speed "*|*" mhc "*)
  timeout "${MHC_BENCH_TIMEOUT:-200}" python3 scripts/bench_mhc.py --seq-len "${MHC_SEQ:-4096}" 2>&1 \
      | tee "$OUT/bench_mhc.log" ;;
esac
pack_cache
case " $STAGES " in *" speed "*|*" against "*)
  timeout "${AGAINST_TIMEOUT:-300}" python3 scripts/benchmark.py --flavor glm5_3_flash_proxy --against transformers \
      --seq-len "${AGAINST_SEQ:-4096}" --steps 4 --warmup 2 --runs "${AGAINST_RUNS:-compiled:none}" \
      --out "$OUT/bench_against.json" 2>&1 | tee "$OUT/bench_against.log" ;;
esac
pack_cache
case " $STAGES " in *" proxytrain "*)
  # the proxy training config as users run it (log steps every 5: the window's tokens/s has no per-step host read)
  timeout "${PROXY_TIMEOUT:-540}" torchrun --nproc-per-node 1 train.py --config train_configs/glm5_3_flash_proxy.toml \
      --training.steps "${PROXY_STEPS:-30}" --metrics.log_freq 5 --checkpoint.enable false \
      --metrics.enable_tensorboard false --job.dump_folder "$OUT/proxy_train" ${PROXY_ARGS:-} 2>&1 | tee "$OUT/proxy_train.log" ;;
esac
pack_cache
case " $STAGES " in *" accum "*)
  # issue 12: train.py against the training-scope benchmark, same call: the benchmark (compiled, selective AC), then
  # train.py one row per step and with ACCUM_GLOBAL rows per step (gradient accumulation, fsdp_reshard_after_forward
  # ACCUM_RESHARD), both under AC mode ACCUM_AC (default selective); the log lines' tokens/s after compile are the
  # figures
  ac=${ACCUM_AC:-selective}
  [ "${ACCUM_BENCH:-1}" = 1 ] && timeout "${BENCH_TIMEOUT:-240}" python3 scripts/benchmark.py \
      --flavor glm5_3_flash_proxy --seq-len 4096 --steps 5 --warmup 2 --runs "compiled:$ac" --scope train \
      --out "$OUT/bench_train_$ac.json" 2>&1 | tee "$OUT/bench_train_$ac.log"
  for g in ${ACCUM_GLOBAL_LIST:-1 8}; do
    steps=$(( g == 1 ? 20 : 10 ))
    timeout "${ACCUM_TIMEOUT:-240}" torchrun --nproc-per-node 1 train.py --config train_configs/glm5_3_flash_proxy.toml \
        --training.global_batch_size "$g" --parallelism.fsdp_reshard_after_forward "${ACCUM_RESHARD:-never}" \
        --activation_checkpoint.mode "$ac" --training.steps "$steps" --metrics.log_freq 5 --checkpoint.enable false \
        --metrics.enable_tensorboard false --job.dump_folder "$OUT/accum_${ac}_$g" ${ACCUM_ARGS:-} 2>&1 \
        | tee "$OUT/accum_${ac}_$g.log"
  done ;;
esac
pack_cache
case " $STAGES " in *" optim "*)
  steps=${OPTIM_STEPS:-12}
  for entry in ${OPTIM_NAMES:-AdamW8bit:fused AdamW8bit:compiled AdamWFp8:fused AdamW}; do
    name=${entry%%:*}; impl=auto; [ "$entry" != "$name" ] && impl=${entry#*:}
    tag=${name}_$impl
    timeout "${OPTIM_TIMEOUT:-200}" torchrun --nproc-per-node 1 train.py --config train_configs/glm5_3_flash_proxy.toml \
        --optimizer.name "$name" --optimizer.implementation "$impl" --compile.enable false \
        --activation_checkpoint.mode full --training.steps "$steps" --metrics.log_freq 1 \
        --checkpoint.enable false --metrics.enable_tensorboard false --job.dump_folder "$OUT/optim_$tag" \
        --profiling.enable true --profiling.start_step $((steps - 1)) --profiling.steps 2 2>&1 | tee "$OUT/optim_$tag.log"
    rm -f "$OUT/optim_$tag"/profile_trace/*.json.gz  # the table is what comes back; traces are tens of MB
  done ;;
esac
pack_cache
case " $STAGES " in *" optimbench "*)
  # issue 12: the optimizer step alone over the proxy's parameters, fused against torchao's compiled step
  timeout "${OPTIMBENCH_TIMEOUT:-300}" python3 scripts/bench_optim.py ${OPTIMBENCH_ARGS:-} --json "$OUT/bench_optim.json" \
      2>&1 | tee "$OUT/bench_optim.log" ;;
esac
pack_cache
case " $STAGES " in *" fp8curve "*)
  # issue 8: 200 proxy steps through train.py in BF16 and in the FP8 split, same seed and data, every step logged;
  # one precision per device call (FP8CURVE_PREC="bf16" then "fp8"; "bf16b": BF16 again, whose difference from the
  # first is the noise floor of the comparison): the runs stay under $CACHE while the machine is warm and their
  # TensorBoard events come back in $OUT; scripts/compare_runs.py compares the end of the curves.
  for prec in ${FP8CURVE_PREC:-bf16 fp8}; do
    extra=""; [ "$prec" = fp8 ] && extra="--float8.enable true"
    timeout "${FP8CURVE_TIMEOUT:-560}" torchrun --nproc-per-node 1 train.py --config train_configs/glm5_3_flash_proxy.toml \
        --training.steps "${FP8CURVE_STEPS:-200}" --training.seq_len "${FP8CURVE_SEQ:-4096}" --metrics.log_freq 1 \
        --checkpoint.enable false --job.dump_folder "$CACHE/fp8curve/$prec" $extra ${FP8CURVE_ARGS:-} 2>&1 \
        | tee "$OUT/fp8curve_$prec.log"
    mkdir -p "$OUT/fp8curve_$prec" && cp -r "$CACHE/fp8curve/$prec/tb" "$OUT/fp8curve_$prec/"
  done
  floor=""; [ -d "$CACHE/fp8curve/bf16b/tb" ] && floor="--floor $CACHE/fp8curve/bf16b"
  [ -d "$CACHE/fp8curve/bf16/tb" ] && [ -d "$CACHE/fp8curve/fp8/tb" ] && python3 scripts/compare_runs.py \
      "$CACHE/fp8curve/bf16" "$CACHE/fp8curve/fp8" --last 20 --max-rel 0.01 $floor 2>&1 \
      | tee "$OUT/fp8curve_compare.log" ;;
esac
pack_cache
# The proxy trained ROLLOUT_TRAIN_STEPS steps (eager, full AC; random weights give near-uniform log-probs, a Pearson
# of noise), exported as BF16 HF weights only, once per warm machine: prints its folder.
trained_proxy() {
  local dir="$CACHE/rollout_px/checkpoint/hf-step-${ROLLOUT_TRAIN_STEPS:-30}"
  if [ ! -f "$dir/config.json" ]; then
    timeout "${PROXY_TIMEOUT:-400}" torchrun --nproc-per-node 1 train.py --config train_configs/glm5_3_flash_proxy.toml \
        --compile.enable false --activation_checkpoint.mode full --training.steps "${ROLLOUT_TRAIN_STEPS:-30}" \
        --metrics.log_freq 10 --metrics.enable_tensorboard false --checkpoint.enable true --checkpoint.interval 100000 \
        --checkpoint.last_save_in_hf true --checkpoint.last_save_model_only true --job.dump_folder "$CACHE/rollout_px" \
        > "$OUT/rollout_train.log" 2>&1
  fi
  echo "$dir"
}
case " $STAGES " in *" serving "*)
  gpu_pytest "$OUT/decode_tests.log" tests/gpu/test_decode_cuda.py
  # first train the proxy (trained_proxy) unless ROLLOUT_SOURCE names a checkpoint or ROLLOUT_TRAIN_STEPS=0
  src=${ROLLOUT_SOURCE:-}
  if [ -z "$src" ] && [ "${ROLLOUT_TRAIN_STEPS:-30}" -gt 0 ]; then
    src="--hf $(trained_proxy)"
  fi
  timeout "${ROLLOUT_TIMEOUT:-500}" python3 scripts/rollout_agreement.py ${src:---flavor glm5_3_flash_proxy} \
      --precisions "${ROLLOUT_PRECISIONS:-bf16,fp8_split,fp8_indexer,fp8_indexer_trained}" --num-sequences 16 \
      --prompt-len 512 --continuation-len 128 --json "$OUT/rollout_agreement.json" 2>&1 | tee "$OUT/rollout_agreement.log"
  timeout "${DECODE_BENCH_TIMEOUT:-400}" python3 scripts/bench_decode.py --flavor glm5_3_flash_proxy --batch 1,64 \
      --prompt-len 512 --steps 64 --json "$OUT/bench_decode.json" 2>&1 | tee "$OUT/bench_decode.log" ;;
esac
pack_cache
case " $STAGES " in *" agreement "*)
  # issue 8: scripts/precision_agreement.py on trained weights (the targets are for a trained checkpoint)
  timeout "${AGREEMENT_TIMEOUT:-300}" python3 scripts/precision_agreement.py --hf "$(trained_proxy)" --seq-len 4096 \
      --json "$OUT/agreement_trained.json" 2>&1 | tee "$OUT/agreement_trained.log" ;;
esac
pack_cache
case " $STAGES " in *" multigpu "*)
  ngpu=$(nvidia-smi -L | wc -l)
  export NCCL_NVLS_ENABLE=0
  for n in ${MULTI_N:-1 2 4 8}; do
    [ "$n" -le "$ngpu" ] || continue
    timeout "${MULTI_TIMEOUT:-900}" torchrun --nproc-per-node "$n" train.py --config train_configs/glm5_3_flash_proxy.toml \
        --parallelism.expert_parallel_degree "$n" --float8.enable true --training.steps "${MULTI_STEPS:-50}" \
        --metrics.log_freq 5 --job.dump_folder "$OUT/multigpu_n$n" 2>&1 | tee "$OUT/multigpu_n$n.log"
  done
  if [ "$ngpu" -ge 2 ]; then
    timeout "${MULTI_TIMEOUT:-900}" torchrun --nproc-per-node "$ngpu" train.py --config train_configs/glm5_3_flash_proxy.toml \
        --parallelism.context_parallel_degree 2 --parallelism.expert_parallel_degree "$ngpu" --float8.enable true \
        --training.seq_len "${MULTI_CP_SEQ:-32768}" --training.steps "${MULTI_STEPS:-50}" --metrics.log_freq 5 \
        --job.dump_folder "$OUT/multigpu_cp2" 2>&1 | tee "$OUT/multigpu_cp2.log"
  fi ;;
esac
pack_cache
case " $STAGES " in *" train "*)
  timeout "${TRAIN_TIMEOUT:-300}" torchrun --nproc-per-node 1 train.py --config train_configs/debug_model.toml \
      --training.mixed_precision_param bfloat16 --compile.enable true --compile.backend inductor \
      --training.steps 10 --metrics.log_freq 2 --checkpoint.enable false --job.dump_folder "$OUT/train" \
      2>&1 | tee "$OUT/train.log" ;;
esac
pack_cache
ls -la "$OUT"
