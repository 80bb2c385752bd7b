"""The planner's parameter, gradient and optimizer-state bytes per rank equal what the trainer's ranks hold after a
step (2 gloo ranks): DTensor local shards and the parameters kept out of FSDP2, the reduce-scattered gradient
buffers, AdamW's states and step counters. Layouts: FSDP2 over both ranks, tensor parallel over both
(debug_model_2d.toml), FSDP2 x expert parallel 2 (debug_model_ep.toml). FSDP2 configs: the debug model as it ships
(FP32 compute), and
BF16 compute + FP8 + dense warm-up (only the indexer trains) + a frozen KPool APE + 3 indexer heads (a weight of 3
rows: FSDP2 pads its shards to 2 rows on both ranks, rank 1's optimizer state holds 1)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_glm.planner.core import build_inventory, load_request, Request
from torchtitan_glm.planner.hardware import H200
from torchtitan_glm.planner.layout import resolve_layout
from torchtitan_glm.planner.params import state_bytes

from .test_train import _free_port

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = [
    "--config train_configs/debug_model.toml",
    "--config train_configs/debug_model.toml --training.mixed_precision_param bfloat16 --float8.enable true "
    "--loss.indexer_stage dense_warmup --model.kpool_ape_trainable false --model.index_n_heads 3",
    "--config train_configs/debug_model_2d.toml",  # tensor parallel over both ranks
    "--config train_configs/debug_model_ep.toml --training.mixed_precision_param bfloat16",  # FSDP2 x EP 2
]


@pytest.mark.long
def test_planned_state_bytes_equal_what_ranks_hold(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={_free_port()}",
           str(Path(__file__).with_name("_planner_worker.py")), ";".join(CONFIGS)]
    env = dict(os.environ, TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", OMP_NUM_THREADS="1", PLANNER_OUT=str(tmp_path))
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-6000:]
    for rank in range(2):
        held = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for args, got in zip(CONFIGS, held):
            cfg, fields, _ = load_request(Request(tuple(args.split()), 2, H200))
            layout = resolve_layout(fields, gpus=2, config=cfg.parallelism)
            fsdp_rank = rank // layout.tp % layout.fsdp  # the rank's coordinate in the FSDP mesh
            planned = state_bytes(build_inventory(cfg, scope="train"), layout, rank=fsdp_rank)
            want = {"params": planned.params, "grads": planned.grads, "optimizer": planned.optimizer,
                    "replicated_params": planned.replicated_params}
            assert got == want, (rank, args, got, want)
            assert planned.grads < planned.params if "dense_warmup" in args else planned.grads == planned.params
    assert json.loads((tmp_path / "rank0.json").read_text())[1]["optimizer"] > \
        json.loads((tmp_path / "rank1.json").read_text())[1]["optimizer"]  # the uneven shard
