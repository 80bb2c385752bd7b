"""metrics.py: parameter/FLOP counts, MFU peak lookup, console line, memory monitor, TensorBoard events."""

import glob
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from torchtitan_glm.components.metrics import (
    DeviceMemoryMonitor,
    build_metrics_logger,
    count_params,
    expert_load_imbalance,
    flops_breakdown,
    flops_per_token,
    format_eta,
    format_step_line,
    get_peak_flops,
    throughput,
)
from torchtitan_glm.config import MetricsConfig
from torchtitan_glm.models.glm5.args import get_flavor


def test_param_counts_match_transformers_reference():
    """Shape-only counts agree with the parameters of transformers' glm5_next text model (which has no MTP/head)."""
    hf = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    args = get_flavor("debug").replace(num_nextn_predict_layers=0)
    model = hf.Glm5NextTextModel(Glm5NextTextConfig(**args.to_hf_config()))
    d, v = args.hidden_size, args.vocab_size
    hf_total = sum(p.numel() for p in model.parameters())
    counts = count_params(args)
    assert counts.total == hf_total + d * v  # + lm_head
    n_moe = sum(t == "sparse" for t in args.mlp_layer_types)
    idle_experts = n_moe * (args.n_routed_experts - args.num_experts_per_tok) * 3 * d * args.moe_intermediate_size
    assert counts.active == hf_total - d * v + d * v - idle_experts  # - embedding + lm_head - unrouted experts


def test_mtp_adds_a_dsa_moe_layer_and_a_head_pass():
    args = get_flavor("debug")
    with_mtp, without = count_params(args), count_params(args.replace(num_nextn_predict_layers=0))
    d = args.hidden_size
    extra = with_mtp.active - without.active
    assert extra > 2 * d * d + args.hidden_size * args.vocab_size  # eh_proj + second LM head pass, plus a layer
    assert with_mtp.total - without.total == extra - d * args.vocab_size + (
        args.n_routed_experts - args.num_experts_per_tok) * 3 * d * args.moe_intermediate_size


def test_flops_params_term_is_six_n_and_terms_sum():
    args = get_flavor("debug")
    fb = flops_breakdown(args, 256)
    assert fb.params == 6 * count_params(args).active
    assert flops_per_token(args, 256) == fb.total == fb.params + fb.kda + fb.dsa + fb.indexer
    k = args.linear_head_dim
    assert fb.kda == 12 * args.linear_num_heads * k * k * sum(t == "linear_attention" for t in args.layer_types)
    # a model without attention-like terms (duck-typed: no KDA layers, no MTP, zero heads) is exactly 6 N
    bare = SimpleNamespace(**{**vars(args), "layer_types": ["indexed_attention"] * 4, "num_attention_heads": 0,
                              "index_n_heads": 0, "num_nextn_predict_layers": 0})
    bare.qk_head_dim = args.qk_head_dim
    fb0 = flops_breakdown(bare, 256)
    assert fb0.kda == fb0.dsa == fb0.indexer == 0 and fb0.total == 6 * count_params(bare).active


def brute_force_attended(args, seq_len):
    total, pools_total = 0, 0
    for t in range(seq_len):
        visible = t + 1
        pools = visible // args.index_kpool
        chosen = min(pools, args.index_topk // args.index_kpool) * args.index_kpool
        total += chosen + visible % args.index_kpool
        pools_total += pools
    return total / seq_len, pools_total / seq_len


@pytest.mark.parametrize("seq_len", [1, 7, 16, 50, 300])
def test_dsa_and_indexer_terms_match_brute_force(seq_len):
    args = get_flavor("debug")  # index_topk 16, kpool 4, 1 DSA layer + the MTP layer
    attended, pools = brute_force_attended(args, seq_len)
    n_dsa = 1 + args.num_nextn_predict_layers
    fb = flops_breakdown(args, seq_len)
    h, dqk, dv = args.num_attention_heads, args.qk_head_dim, args.v_head_dim
    assert fb.dsa == pytest.approx(3 * 2 * h * (dqk + dv) * attended * n_dsa)
    assert fb.indexer == pytest.approx(3 * 2 * args.index_n_heads * args.index_head_dim * pools * n_dsa)
    assert attended <= args.index_topk + args.index_kpool - 1


def test_attention_terms_grow_with_seq_len_and_dense_is_quadratic():
    args = get_flavor("debug")
    seqs = [8, 16, 64, 256, 1024]
    dsa = [flops_breakdown(args, s).dsa for s in seqs]
    idx = [flops_breakdown(args, s).indexer for s in seqs]
    assert all(b > a for a, b in zip(dsa, dsa[1:])) and all(b > a for a, b in zip(idx, idx[1:]))
    assert dsa[-1] < 3 * 2 * 4 * 32 * (16 + 3) * 2  # capped by index_topk + kpool - 1 attended keys
    assert len({flops_breakdown(args, s).kda for s in seqs}) == 1  # linear attention: independent of seq_len
    dense = args.replace(dsa_attention="dense")
    h, d = dense.num_attention_heads, dense.qk_head_dim + dense.v_head_dim
    for s in seqs:
        assert flops_breakdown(dense, s).dsa == pytest.approx(3 * 2 * h * d * (s + 1) / 2 * 2)
    full = get_flavor("glm5_3_flash")
    assert 100e9 < flops_per_token(full, 4096) < 130e9  # ~17.8B active params -> ~1.1e11 FLOPs/token


def test_peak_flops_and_throughput():
    assert get_peak_flops("NVIDIA H200") == 989e12
    assert get_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert get_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert get_peak_flops("Some Future Accelerator") is None
    if not torch.cuda.is_available():
        assert get_peak_flops() is None
    tps, tflops, mfu = throughput(tokens=4096, seconds=2.0, flops_per_token=1e9, peak_flops=989e12)
    assert tps == 2048 and tflops == pytest.approx(2.048) and mfu == pytest.approx(100 * 2.048e12 / 989e12)
    assert throughput(tokens=1, seconds=1.0, flops_per_token=1.0, peak_flops=None)[2] is None


def test_console_line():
    line = format_step_line(step=10, total_steps=100, loss=3.21, tokens_per_sec=12345.6, tflops=123.45,
                            mfu_pct=12.48, peak_mem_gib=10.254, eta_seconds=3725, extra={"lr": 3e-4, "gnorm": 1.5})
    assert line == ("step 10/100 | loss 3.2100 | tps 12,346 | tflops 123.5 | mfu 12.5% | mem 10.25GiB | "
                    "eta 1h02m | lr 0.0003 | gnorm 1.5")
    cpu = format_step_line(step=1, total_steps=2, loss=1.0, tokens_per_sec=1.0, tflops=None, mfu_pct=None,
                           peak_mem_gib=0.5, eta_seconds=None)
    assert "mfu -" in cpu and "eta ?" in cpu
    assert format_eta(59) == "59s" and format_eta(61) == "1m01s" and format_eta(7200) == "2h00m"


def test_memory_monitor_cpu():
    mon = DeviceMemoryMonitor("cpu")
    before = mon.get_peak_stats()
    assert before.max_active_gib > 0.01 and 0 < before.max_reserved_pct < 100
    block = np.ones(64 * 1024 * 1024 // 8)  # touch 64 MiB
    after = mon.get_peak_stats()
    assert after.max_active_gib >= before.max_active_gib and block.sum() > 0


def test_expert_load_imbalance():
    assert float(expert_load_imbalance([5, 5, 5, 5])) == 1.0
    assert float(expert_load_imbalance(torch.tensor([8, 0, 0, 0]))) == 4.0
    per_layer = expert_load_imbalance(np.array([[1, 1, 2], [0, 0, 0]]))
    assert per_layer.tolist() == pytest.approx([1.5, 1.0])


def test_tensorboard_events_written_and_readable(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = MetricsConfig(enable_tensorboard=True, save_tb_folder="tb")
    logger = build_metrics_logger(cfg=cfg, dump_folder=str(tmp_path), rank=0)
    for step in (1, 2, 3):
        logger.log({"loss": 4.0 - step, "tps": torch.tensor(100.0 * step), "mfu": None}, step)
    logger.close()
    log_dir = tmp_path / "tb"
    assert glob.glob(str(log_dir / "events.out.tfevents.*"))
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"loss", "tps"}
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 3.0), (2, 2.0), (3, 1.0)]
    assert [e.value for e in acc.Scalars("tps")] == pytest.approx([100.0, 200.0, 300.0])

    other = build_metrics_logger(cfg=cfg, dump_folder=str(tmp_path / "r1"), rank=1)  # rank 1 writes nothing
    other.log({"loss": 1.0}, 1)
    other.close()
    assert not other.enabled and not os.path.exists(tmp_path / "r1")
    off = build_metrics_logger(cfg=MetricsConfig(), dump_folder=str(tmp_path / "off"), rank=0)
    assert not off.enabled and not os.path.exists(tmp_path / "off")


def test_tensorboard_event_file_only_once_a_step_is_logged(tmp_path):
    """A run that logs nothing (resumed at training.steps, or failed before its first step) leaves no event file;
    the first logged step opens one; rank 1 and a disabled logger write nothing."""
    from torchtitan_glm.components.metrics import TensorBoardLogger

    idle = TensorBoardLogger(str(tmp_path / "idle"))
    assert idle.enabled
    idle.close()
    assert not (tmp_path / "idle").exists()
    tb = TensorBoardLogger(str(tmp_path / "tb"))
    tb.log({"loss": 1.0}, 1)
    tb.close()
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1
    for off in (TensorBoardLogger(str(tmp_path / "r1"), rank=1),
                TensorBoardLogger(str(tmp_path / "off"), enable=False)):
        off.log({"loss": 1.0}, 1)
        off.close()
    assert not (tmp_path / "r1").exists() and not (tmp_path / "off").exists()


def test_a_resumed_runs_events_replace_the_earlier_runs_from_its_first_step(tmp_path):
    """A rewound or re-run range shows once in TensorBoard: the resumed run's event file purges what the earlier
    file holds from the resume step on (read back the way TensorBoard reads them)."""
    import time

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from torchtitan_glm.components.metrics import TensorBoardLogger

    first = TensorBoardLogger(str(tmp_path))
    for step in range(1, 7):
        first.log({"loss": float(step)}, step)
    first.close()
    time.sleep(1.1)  # event files are named by the second they open in
    again = TensorBoardLogger(str(tmp_path))
    again.purge_from(4)
    for step in (4, 5):
        again.log({"loss": 10.0 * step}, step)
    again.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]
