"""scripts/benchmark.py runs end to end on the debug flavor (both scopes, with AC) and writes one row per run:
the GPU sessions depend on it, and they are too short to find a broken script there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("scope", [pytest.param("train", marks=pytest.mark.slow), "reference"])  # slow: CI time
def test_benchmark_script_writes_one_row_per_run(tmp_path, scope):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "scripts/benchmark.py", "--flavor", "debug", "--seq-len", "64", "--steps", "1",
         "--warmup", "1", "--runs", "eager:none,eager:selective:fp8", "--scope", scope, "--out", str(out),
         "--recompute-modules", "kda,mhc,moe_act", "--dsa-dense-max-len", "0,64", "--dtype", "float32"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO), "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["mode"], r["ac"], r["scope"], r["float8"], r["dsa_dense_max_len"]) for r in rows] == [
        ("eager", "none", scope, "off", 0), ("eager", "selective+kda+mhc+moe_act", scope, "tensorwise", 0),
        ("eager", "none", scope, "off", 64), ("eager", "selective+kda+mhc+moe_act", scope, "tensorwise", 64)]
    assert all(r["tokens_per_s"] > 0 and r["step_ms"] > 0 for r in rows)
    # what each row converted, counted from its model: nothing BF16; the serving split's Linears and the experts
    assert [(r["float8_linears"] > 0, r["float8_expert_weights"] > 0) for r in rows] == [
        (False, False), (True, True), (False, False), (True, True)]
    # the short-row dense kernel computes the sparse kernel's function: the same loss at init (fp32)
    assert rows[2]["loss"] == pytest.approx(rows[0]["loss"], rel=1e-5)
    assert f"scope: {scope}" in proc.stdout


@pytest.mark.long
def test_fp8_rows_can_keep_the_routed_experts_bf16(tmp_path):
    """--float8-moe-experts off converts the serving split's Linears and leaves the grouped experts BF16, so FP8's
    two parts can be timed apart; the table says what each row converted."""
    out = tmp_path / "bench.json"
    proc = _run("scripts/benchmark.py", "--flavor", "debug", "--seq-len", "32", "--steps", "1", "--warmup", "0",
                "--runs", "eager:none:fp8", "--float8-moe-experts", "off", "--scope", "reference", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["float8"] == "tensorwise" and row["float8_linears"] > 0 and row["float8_expert_weights"] == 0
    assert f"tensorwise ({row['float8_linears']} Linear, 0 expert weights)" in proc.stdout


@pytest.mark.long
def test_runs_name_their_own_recompute_modules(tmp_path):
    """`selective+kda` in --runs times that recompute choice beside others in one call; runs naming none take
    --recompute-modules. Recomputing changes what is saved, not the function: the same loss at init (fp32)."""
    out = tmp_path / "bench.json"
    proc = _run("scripts/benchmark.py", "--flavor", "debug", "--seq-len", "32", "--steps", "1", "--warmup", "0",
                "--runs", "eager:selective,eager:selective+kda+mla_up_proj,eager:none,eager:auto",
                "--recompute-modules", "mhc", "--scope", "reference", "--dtype", "float32", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    # auto is selective at this T (full above 32K), so it takes --recompute-modules too
    assert [r["ac"] for r in rows] == ["selective+mhc", "selective+kda+mla_up_proj", "none", "selective+mhc"]
    for row in rows[1:]:
        assert row["loss"] == pytest.approx(rows[0]["loss"], rel=1e-6)
    assert "| selective+kda+mla_up_proj |" in proc.stdout


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(REPO), "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"})


@pytest.mark.slow  # ~60 s on the CI machine
def test_benchmark_sweeps_lengths_with_auto_ac_and_both_kl_forms(tmp_path):
    rows = []
    for kl in ("sparse", "dense"):
        out = tmp_path / f"{kl}.json"
        proc = _run("scripts/benchmark.py", "--flavor", "debug", "--seq-len", "32,64", "--steps", "1", "--warmup", "0",
                    "--runs", "eager:auto", "--docs", "2", "--indexer-kl", kl, "--out", str(out))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"indexer KL {kl}, indexer tiles of {1 << 26} elements, 2 document(s) per row" in proc.stdout
        rows += json.loads(out.read_text())
    assert [(r["seq_len"], r["ac"], r["indexer_kl"]) for r in rows] == [
        (32, "selective", "sparse"), (64, "selective", "sparse"),
        (32, "selective", "dense"), (64, "selective", "dense")]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="per-run host peaks need Linux")
@pytest.mark.long
def test_sweep_rows_report_their_own_host_peak_and_offload(tmp_path):
    """Each row's host_peak_rss_gib is its own run's (VmHWM restarted per run): a short row after a long one reports
    less. offload_inputs rows say so; on the CPU nothing is pinned, so none is counted as offloaded."""
    out = tmp_path / "rows.json"
    proc = _run("scripts/benchmark.py", "--flavor", "debug", "--seq-len", "4096,256", "--steps", "1", "--warmup", "0",
                "--runs", "eager:full", "--offload-inputs", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    long, short = json.loads(out.read_text())
    assert (long["ac"], long["offload_inputs"], long["offloaded_gib_per_step"]) == ("full+offload", True, 0.0)
    assert 0 < short["host_peak_rss_gib"] < long["host_peak_rss_gib"], (short, long)
    # the host memory by kind after the steps (on CUDA also the pinned caching allocator's)
    after = long["host_gib_after"]
    assert set(after) == {"anon", "file", "shmem"} and 0 < after["anon"] <= long["host_peak_rss_gib"], after


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message shown without CUDA")
@pytest.mark.long
def test_gpu_benchmarks_say_they_need_cuda():
    proc = _run("scripts/benchmark.py", "--seq-len", "sweep", "--runs", "compiled:auto")
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr and "on CPU use --flavor debug" in proc.stderr
    proc = _run("scripts/benchmark.py", "--against", "transformers")  # the default flavor is the proxy
    assert proc.returncode == 2 and "on CPU use --flavor debug" in proc.stderr, proc.stderr[-2000:]
    # --memory-profile records CUDA allocations: refused before any run rather than silently dropped
    proc = _run("scripts/benchmark.py", "--flavor", "debug", "--seq-len", "32", "--runs", "eager:none",
                "--memory-profile")
    assert proc.returncode == 2 and "--memory-profile" in proc.stderr and "needs CUDA" in proc.stderr, proc.stderr
    assert proc.stdout == ""
    proc = _run("scripts/bench_dsa.py")
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr
    proc = _run("scripts/bench_sparse_mla_configs.py")
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr
    proc = _run("scripts/bench_kda.py")
    assert proc.returncode == 2 and "needs CUDA" in proc.stderr
    proc = _run("scripts/bench_mhc.py")
    assert proc.returncode == 2 and "needs CUDA" in proc.stderr
    proc = _run("scripts/bench_optim.py")
    assert proc.returncode == 2 and "needs CUDA" in proc.stderr
    proc = _run("scripts/bench_causal_conv.py")
    assert proc.returncode == 2 and "no CUDA device is visible" in proc.stderr
    proc = _run("scripts/bench_causal_conv.py", "--seq-len", "16", "--docs", "17")  # flags first, then CUDA
    assert proc.returncode == 2 and "--docs 17" in proc.stderr
    proc = _run("scripts/bench_optim.py", "--kernel-rows", "checked:1x2,fast:1x2")  # flags first, then CUDA
    assert proc.returncode == 2 and "--kernel-rows 'fast:1x2'" in proc.stderr


def test_bench_dsa_variants_run_on_cpu(monkeypatch):
    """bench_dsa.py's timed closures, run once each on CPU at a small T (the script itself refuses CPU)."""
    import importlib.util

    import torch

    monkeypatch.syspath_prepend(str(REPO / "scripts"))  # as `python scripts/bench_dsa.py` has it (cuda_timing)
    spec = importlib.util.spec_from_file_location("bench_dsa", REPO / "scripts" / "bench_dsa.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    idx = bench.causal_selection(40, 19, "cpu")
    t = torch.arange(40).view(1, 40, 1)
    assert ((idx <= t) | (idx == -1)).all() and (idx[0, 30] >= 0).all() and (idx[0, 5] >= 0).sum() == 6
    variants = {**bench.attention_variants(40, 19, device="cpu", dtype=torch.float32),
                **bench.layer_variants(32, device="cpu", flavor="debug", dtype=torch.float32)}
    assert len(variants) == 12
    for fn in variants.values():
        fn()
    # FLOPs per fwd + bwd: 4 queries with K = 2 attend 1 + 2 + 2 + 2 latent tokens; dense: 16 and 10 pairs
    flops = bench.attention_flops(4, 2)
    assert flops["sparse op (absorbed, K gathered)"] == 14 * 512 * 64 * 7
    assert flops["dense SDPA, [T, T] mask"] == (8 * 256 + 6 * 256) * 64 * 16
    assert flops["dense SDPA, causal"] == (8 * 256 + 6 * 256) * 64 * 10
    # rows 0-1 causal (3 pairs), then rows 2-3 over all 4 keys (one chunk of 1024)
    assert flops["dense SDPA, first 2 rows causal, then [T, T] mask in query chunks of 1024"] == (
        (8 * 256 + 6 * 256) * 64 * (3 + 8))


def test_benchmark_against_transformers_same_tokens_same_weights_and_ratios(tmp_path):
    """--against transformers on CPU (fp32, debug flavor): the transformers row first, then ours from its weights on
    its tokens, so the losses at init agree to fp32 precision; every row of ours carries positive ratios."""
    out = tmp_path / "against.json"
    proc = _run("scripts/benchmark.py", "--flavor", "debug", "--seq-len", "32", "--steps", "1", "--warmup", "0",
                "--runs", "eager:none", "--against", "transformers", "--dtype", "float32", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref, ours = json.loads(out.read_text())
    assert (ref["mode"], ours["mode"]) == ("transformers", "eager")
    assert ref["scope"] == ours["scope"] == "reference" and ref["seq_len"] == ours["seq_len"] == 32
    assert ref["tokens_sha1"] == ours["tokens_sha1"]
    assert abs(ours["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), (ours["loss"], ref["loss"])
    for r in (ref, ours):
        assert r["tokens_per_s"] > 0 and r["peak_mem_gib"] > 0
    assert ours["speed_ratio"] > 0 and ours["memory_ratio"] > 0
    assert abs(ours["speed_ratio"] - ours["tokens_per_s"] / ref["tokens_per_s"]) < 1e-2 * ours["speed_ratio"]
    assert abs(ours["memory_ratio"] - ours["peak_mem_gib"] / ref["peak_mem_gib"]) < 1e-2 * ours["memory_ratio"]
    assert "speed / memory vs transformers" in proc.stdout
    assert f"| {ours['speed_ratio']}x, {ours['memory_ratio']}x |" in proc.stdout


def test_benchmark_against_transformers_refuses_train_scope():
    proc = _run("scripts/benchmark.py", "--flavor", "debug", "--against", "transformers", "--scope", "train")
    assert proc.returncode == 2 and "--against transformers compares the reference scope" in proc.stderr


@pytest.mark.parametrize("args,named", [
    (("--runs", "eager:foo"), "--runs"), (("--runs", "eager"), "--runs"), (("--runs", "eager:none:fp16"), "--runs"),
    (("--seq-len", "4k"), "--seq-len"), (("--moe-chunk-tokens", "-3"), "--moe-chunk-tokens"),
    (("--recompute-modules", "kda", "--runs", "eager:none"), "--recompute-modules"),
    (("--recompute-modules", "kda,kda", "--runs", "eager:selective"), "has duplicates"),
    (("--recompute-modules", "nosuch", "--runs", "eager:selective"), "unknown module 'nosuch'"),
    (("--offload-inputs", "--runs", "eager:selective"), "--offload-inputs"),
    (("--kda-disable-recompute", "--docs", "2"), "--kda-disable-recompute needs rows without document ids"),
    (("--runs", "eager:full+kda"), "'eager:full+kda' is not mode:ac"),
    (("--runs", "eager:selective+kda+kda"), "has duplicates"),
    (("--runs", "eager:selective+nosuch"), "unknown module 'nosuch'"),
    (("--seq-len", "128", "--docs", "65"), "--docs"), (("--flavor", "nosuch"), "--flavor"),
    (("--out", "/nonexistent/folder/rows.json"), "--out"),
])
@pytest.mark.long
def test_benchmark_bad_arguments_exit_2_naming_the_option(args, named):
    proc = _run("scripts/benchmark.py", "--flavor", "debug", *args, timeout=120)
    assert proc.returncode == 2 and named in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_bench_kda_variants_run_on_cpu(monkeypatch):
    """bench_kda.py's closures other than FLA's (CUDA only), once each on CPU on the debug flavor: the blocks and
    their parts (the GEMMs, our KDA op). The parts' GEMMs are the block's own projections."""
    import importlib.util

    import torch

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    spec = importlib.util.spec_from_file_location("bench_kda", REPO / "scripts" / "bench_kda.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    fns, args = bench.variants("debug", 24, "cpu", torch.float32, with_fla=False, compile_ours=False)
    assert list(fns) == ["ours, eager", "parts: the block's GEMMs", "parts: our KDA op (gate computed outside)",
                         "parts: our KDA op, save_states (gate computed outside)"]
    for fn in fns.values():
        fn()


def test_bench_mhc_variants_run_on_cpu(monkeypatch):
    """bench_mhc.py's closures (both merge forms, alone and in the whole site), once each on CPU, compiled with
    aot_eager on the debug flavor's widths."""
    import importlib.util

    import torch

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    spec = importlib.util.spec_from_file_location("bench_mhc", REPO / "scripts" / "bench_mhc.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    fns = bench.variants(16, "cpu", torch.float32, flavor="debug", backend="aot_eager")
    assert len(fns) == 4
    for fn in fns.values():
        fn()


def test_cpu_peak_counts_temporaries_inside_custom_ops():
    # The project's custom ops run below the dispatch mode; their temporaries must still count (a 64 MiB one here).
    sys.path.insert(0, str(REPO / "scripts"))
    from benchmark import CpuPeak

    @torch.library.custom_op("torchtitan_glm::_cpu_peak_probe", mutates_args=())
    def probe(x: torch.Tensor) -> torch.Tensor:
        tmp = torch.ones(16 << 20)  # 64 MiB, freed before the op returns
        return x + tmp[:1]

    x = torch.ones(4)
    meter = CpuPeak([x])
    with meter:
        y = probe(x)
    assert torch.equal(y, x + 1)
    assert 64 << 20 <= meter.peak_bytes - x.untyped_storage().nbytes() < (64 << 20) + 4096


@pytest.mark.long
def test_profile_on_cpu_and_the_table_shows_moe_chunk_tokens(tmp_path):
    """--profile prints the profiled step's ops on CPU too; the markdown table has a column for
    --moe-chunk-tokens (in the JSON rows), so runs differing only in chunk size are told apart."""
    out = tmp_path / "rows.json"
    proc = _run("scripts/benchmark.py", "--flavor", "debug", "--seq-len", "32", "--steps", "1", "--warmup", "0",
                "--runs", "eager:none", "--moe-chunk-tokens", "16", "--profile", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Self CPU time total" in proc.stdout
    (row,) = json.loads(out.read_text())
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    header, body = [c.strip() for c in table[0].split("|")], [c.strip() for c in table[1].split("|")]
    assert len(header) == len(body) and body[header.index("MoE chunk")] == str(row["moe_chunk_tokens"]) != "0"
    assert body[header.index("DSA dense max")] == str(row["dsa_dense_max_len"])


@pytest.mark.long
def test_profile_match_keeps_the_named_rows_and_sums_their_self_time(tmp_path):
    """--profile-match prints only the profiled ops whose names hold one of the substrings, with their count and
    summed self time (on CPU, ops' self CPU time; the sum equals the rows' own column); without --profile the
    shaping flags are refused."""
    import re

    proc = _run("scripts/benchmark.py", "--flavor", "debug", "--seq-len", "32", "--steps", "1", "--warmup", "0",
                "--runs", "eager:none", "--profile", "--profile-match", "aten::mm,ADDMM", "--profile-rows", "100")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.lstrip().startswith("aten::")]
    names = {line.split()[0] for line in rows}
    assert names == {"aten::mm", "aten::addmm"} or names == {"aten::mm"}, names
    (summary,) = re.findall(r"rows matching aten::mm, ADDMM: (\d+), their self CPU time summed: ([\d.]+) ms",
                            proc.stdout)
    assert int(summary[0]) == len(rows) and float(summary[1]) > 0
    # the filtered table's own total (torch's formatting: us, ms or s, three decimals) is the same sum
    value, unit = re.search(r"Self CPU time total: ([\d.]+)(us|ms|s)\b", proc.stdout).groups()
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]
    assert float(value) * scale == pytest.approx(float(summary[1]), abs=2e-3 + 5e-4 * scale)
    for bad, named in ((["--profile-match", "mm"], "add --profile"), (["--profile", "--profile-rows", "0"],
                                                                       "--profile-rows 0")):
        proc = _run("scripts/benchmark.py", "--flavor", "debug", "--seq-len", "32", "--runs", "eager:none", *bad)
        assert proc.returncode == 2 and named in proc.stderr, proc.stderr[-2000:]


def test_profile_match_sums_kernels_once_on_cuda(monkeypatch):
    """On CUDA an op's self time is its kernels' time: a cast op and its Triton kernel both matching must count the
    kernel once (the sum takes kernel rows only); on CPU ops' self times add up."""
    import importlib.util
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    spec = importlib.util.spec_from_file_location("benchmark", REPO / "scripts" / "benchmark.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    op = SimpleNamespace(device_type=DeviceType.CPU, self_device_time_total=7222.0, self_cpu_time_total=4077.0)
    kernel = SimpleNamespace(device_type=DeviceType.CUDA, self_device_time_total=7222.0, self_cpu_time_total=0.0)
    other = SimpleNamespace(device_type=DeviceType.CUDA, self_device_time_total=6583.0, self_cpu_time_total=0.0)
    assert bench.matched_self_us([op, kernel, other], cuda=True) == 7222.0 + 6583.0
    assert bench.matched_self_us([op, kernel, other], cuda=False) == 4077.0


def test_micro_benchmark_argument_types(monkeypatch):
    """The GPU micro-benchmarks' integer flags: a non-integer, a value below the floor or an empty list entry is an
    argparse error (exit 2) before any CUDA check."""
    import argparse

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    from cuda_timing import at_least, int_list, kernel_configs

    assert at_least(0)("0") == 0 and int_list()("4096, 8192") == (4096, 8192)
    assert kernel_configs("64,32,8,2;32,16,8,1") == ((64, 32, 8, 2), (32, 16, 8, 1))
    for parse, text in ((at_least(1), "0"), (at_least(0), "-1"), (at_least(1), "2.5"), (int_list(), "4096,"),
                        (int_list(), "abc"), (int_list(), "8192,0"), (kernel_configs, "64,32,8"),
                        (kernel_configs, "64,32,8,2;"), (kernel_configs, "64,32,0,2")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


@pytest.mark.parametrize("script,args,named", [
    ("bench_dsa.py", ("--seq-len", "4096,"), "--seq-len"), ("bench_dsa.py", ("--steps", "0"), "--steps"),
    ("bench_kda.py", ("--seq-len", "abc"), "--seq-len"), ("bench_causal_conv.py", ("--warmup", "-1"), "--warmup"),
    ("bench_sparse_mla_configs.py", ("--configs", "64,32,8;32,16,8,1"), "--configs")])
@pytest.mark.long
def test_micro_benchmarks_refuse_bad_flags_before_asking_for_cuda(script, args, named):
    proc = _run(f"scripts/{script}", *args, timeout=120)
    assert proc.returncode == 2 and f"argument {named}" in proc.stderr, proc.stderr[-2000:]


def test_help_cites_files_of_the_repository_and_the_tie_caveat():
    import re

    proc = _run("scripts/benchmark.py", "--help", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cited = re.findall(r"[\w./-]+/[\w.-]+\.md", proc.stdout)
    assert "docs/performance.md" in cited and all((REPO / c).is_file() for c in cited), cited
    assert "no ties" in proc.stdout and "4th" in proc.stdout


@pytest.mark.long
def test_against_transformers_losses_agree_exactly_without_indexer_ties(monkeypatch):
    """The help's tie claim: at T = 64 the debug flavor's 4-head ReLU indexer has exact score ties (ours break them
    toward the earlier pool, torch.topk need not); with 32 indexer heads the two init losses agree to fp32."""
    import importlib.util

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    spec = importlib.util.spec_from_file_location("benchmark", REPO / "scripts" / "benchmark.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "get_flavor", lambda name: bench.FLAVORS[name]().replace(index_n_heads=32))
    cpu, tile = torch.device("cpu"), 1 << 26
    args = bench.model_args("debug", scope="reference", tile_elements=tile)
    seq_len = 4 * args.index_topk  # more pools than the indexer selects: the selection matters
    ref, weights = bench.run_transformers(args=args, flavor="debug", seq_len=seq_len, batch=1, steps=1, warmup=0,
                                          device=cpu, dtype=torch.float32)
    ours = bench.run_one(flavor="debug", seq_len=seq_len, batch=1, compiled=False, ac="none", steps=1, warmup=0,
                         device=cpu, dtype=torch.float32, backend="inductor", scope="reference", profile=False,
                         indexer_kl="dense", docs=1, tile_elements=tile, weights=weights)
    assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-6)


@pytest.mark.long
def test_saved_activations_lists_what_the_kda_block_keeps():
    """scripts/saved_activations.py on CPU (debug flavor): both forms listed, and the compiled block keeps no FP32
    tensor of the KDA width [1, T, heads x head_dim] (the short convs' inputs are saved in BF16)."""
    proc = _run("scripts/saved_activations.py", "--flavor", "debug", "--seq-len", "256", "--min-mib", "0.01")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = {ln.split(":")[0]: ln for ln in proc.stdout.splitlines() if ln.startswith(("eager:", "compiled:"))}
    assert set(lines) == {"eager", "compiled"}, proc.stdout
    assert "[1, 256, 64] float32" not in lines["compiled"], lines["compiled"]
    bad = _run("scripts/saved_activations.py", "--seq-len", "0")
    assert bad.returncode == 2 and "--seq-len" in bad.stderr
