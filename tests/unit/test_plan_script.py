"""scripts/plan.py: layouts the trainer rejects are rejected with the trainer's own messages (exit 2), --what-if plans
them and carries the message, the --json schema (core.PLAN_FIELDS) is what the script prints, and the FLOPs are the
trainer's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_glm.components.metrics import flops_per_token
from torchtitan_glm.config import ConfigError, load_config
from torchtitan_glm.models.glm5.args import KDA
from torchtitan_glm.planner.core import MEMORY_FIELDS, PLAN_FIELDS, SCHEMA, SEARCH_SCHEMA, TIME_FIELDS
from torchtitan_glm.train import build_model_args, check_layout

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from plan import run  # noqa: E402

DEBUG = ["--config", "train_configs/debug_model.toml"]


def _trainer_error(argv: list[str], world: int, monkeypatch) -> str:
    """What train.py says for these arguments on `world` ranks: its config, then its layout check (main() runs both
    before any process group, with torchrun's WORLD_SIZE)."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    try:
        check_layout(load_config(argv))
    except (ConfigError, ValueError) as e:
        return str(e)
    finally:
        monkeypatch.delenv("WORLD_SIZE")
    raise AssertionError(f"the trainer accepts {argv} on {world} ranks")


@pytest.mark.parametrize("layout", [
    ["--parallelism.data_parallel_shard_degree", "3"],  # the degrees' product is not the world size
    ["--parallelism.data_parallel_shard_degree", "0"],  # a bad value: ParallelismConfig.validate
    ["--parallelism.expert_parallel_degree", "3"],  # does not divide the layout (ParallelDims) / the experts
    # context parallel: rows are not a whole number of 2 x cp zigzag chunks of whole pools (validate_model_layout)
    ["--training.seq_len", "120", "--parallelism.data_parallel_shard_degree", "1",
     "--parallelism.context_parallel_degree", "2"],
])
def test_rejected_with_the_trainers_message(layout, monkeypatch):
    with pytest.raises((ConfigError, ValueError)) as err:
        run([*DEBUG, "--gpus", "2", *layout])
    assert str(err.value) == _trainer_error([*DEBUG, *layout], 2, monkeypatch)


def test_script_exits_2_with_the_message(monkeypatch):
    layout = ["--parallelism.data_parallel_shard_degree", "3"]
    res = subprocess.run([sys.executable, "scripts/plan.py", *DEBUG, "--gpus", "2", *layout], cwd=ROOT,
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1"))
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.strip().endswith(f"error: {_trainer_error([*DEBUG, *layout], 2, monkeypatch)}")


@pytest.mark.parametrize("opts,message", [(["--gpus", "0"], "--gpus must be >= 1"),
                                          (["--gpus", "2", "--search", "--top", "0"], "--top must be >= 1"),
                                          (["--gpus", "2", "--search", "--local-batch", "two"], "--local-batch"),
                                          (["--gpus", "2", "--search", "--local-batch", "0,-1"], "--local-batch")])
def test_bad_planner_options_are_named(opts, message):
    from torchtitan_glm.planner import PlanError

    with pytest.raises(PlanError, match=message):
        run([*DEBUG, *opts])


def _check(obj: dict, fields: dict) -> None:
    assert set(obj) == set(fields), set(obj) ^ set(fields)
    for key, (types, _) in fields.items():
        assert isinstance(obj[key], types), (key, obj[key])


def test_json_schema_and_trainer_flops():
    out = json.loads(run([*DEBUG, "--gpus", "2", "--json"]))
    _check(out, PLAN_FIELDS)
    _check(out["memory"], MEMORY_FIELDS)
    _check(out["time"], TIME_FIELDS)
    assert out["schema"] == SCHEMA and out["trainer_accepts"] and out["trainer_message"] is None
    assert out["layout"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "ep": 1, "cp": 1, "expert_fsdp": True}
    assert out["design"] == "parallelize.py"
    cfg = load_config([*DEBUG])
    assert out["time"]["flops_per_token"] == flops_per_token(build_model_args(cfg), cfg.training.seq_len)
    assert out["tokens_per_step"] == 2 * cfg.training.local_batch_size * cfg.training.seq_len
    for c in out["collectives"]:
        assert set(c) == {"name", "group", "calls", "bytes_per_rank", "link", "seconds", "overlapped"}
    mem = out["memory"]
    assert mem["peak_gib"] == pytest.approx(sum(mem["breakdown_gib"].values()), abs=0.01)


def test_what_if_plans_a_rejected_layout_and_keeps_the_message(monkeypatch):
    """ep = 2 inside cp = 4: the trainer wants ep a multiple of cp (its mesh borrows whole cp groups); the cost model
    can describe it, so --what-if plans it with the trainer's message and without --what-if it exits with it."""
    layout = ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.context_parallel_degree", "4",
              "--parallelism.expert_parallel_degree", "2"]
    message = _trainer_error([*DEBUG, *layout], 4, monkeypatch)
    with pytest.raises(ConfigError) as err:
        run([*DEBUG, "--gpus", "4", *layout])
    assert str(err.value) == message
    out = json.loads(run([*DEBUG, "--gpus", "4", "--json", "--what-if", *layout]))
    assert not out["trainer_accepts"] and out["trainer_message"] == message
    assert out["design"].startswith("what-if")
    names = {c["name"] for c in out["collectives"]}
    assert {"cp kda state all-gather", "cp dsa latent all-gather/reduce-scatter", "ep all-to-all"} <= names


def test_context_parallel_plan():
    """CP = 2 (accepted by the trainer): each rank computes half of every row, so half the tokens of a dp = 2 rank
    and smaller activations (but more than half: DSA keeps the gathered latent and pools the whole rows); per step the
    DSA layers (and the MTP's) gather the other rank's latent and indexer keys/gates, the KDA layers their states."""
    argv = [*DEBUG, "--training.seq_len", "2048"]  # activations of a size the JSON's 1/1000 GiB resolves
    cfg = load_config(argv)
    args = build_model_args(cfg)
    bsz, seq = cfg.training.local_batch_size, cfg.training.seq_len
    dp = json.loads(run([*argv, "--gpus", "2", "--json"]))
    cp = json.loads(run([*argv, "--gpus", "2", "--json", "--parallelism.data_parallel_shard_degree", "1",
                         "--parallelism.context_parallel_degree", "2"]))
    assert cp["trainer_accepts"] and cp["design"] == "parallelize.py" and cp["layout"]["cp"] == 2
    assert cp["tokens_per_step"] * 2 == dp["tokens_per_step"] == 2 * bsz * seq
    act = lambda plan: sum(plan["memory"]["activations_by_layer_type_gib"].values())  # noqa: E731
    assert act(dp) / 2 < act(cp) < act(dp)
    colls = {c["name"]: c for c in cp["collectives"]}
    n_kda = sum(t == KDA for t in args.layer_types)
    n_dsa = args.num_hidden_layers - n_kda + args.num_nextn_predict_layers  # the MTP layer attends with DSA
    latent = colls["cp dsa latent all-gather/reduce-scatter"]
    assert latent["calls"] == 2 * n_dsa  # forward all-gather, backward reduce-scatter (no AC)
    # per call each rank receives the other rank's half rows of the latent (FP32 here: the debug config computes FP32)
    assert latent["bytes_per_rank"] == pytest.approx(latent["calls"] * bsz * seq / 2 * args.kv_lora_rank * 4)
    assert colls["cp kda state all-gather"]["calls"] == 2 * n_kda * bsz  # per row, forward and backward
    assert not any(c["name"].startswith("cp ") for c in dp["collectives"])


def test_expert_parallel_plan(monkeypatch):
    """EP over both ranks (accepted by the trainer): the experts leave FSDP2, so no expert is all-gathered; their
    gradients are all-reduced over the expert-data group (size 1 here: none) and the tokens go all-to-all."""
    base = json.loads(run([*DEBUG, "--gpus", "2", "--json"]))
    out = json.loads(run([*DEBUG, "--gpus", "2", "--json", "--parallelism.expert_parallel_degree", "2"]))
    assert out["trainer_accepts"] and out["layout"]["ep"] == 2
    # 8 experts: 4 whole ones per rank (out of FSDP2) instead of half of each -- the same bytes
    assert out["memory"]["state_bytes"]["params"] == base["memory"]["state_bytes"]["params"]
    assert out["memory"]["state_bytes"]["replicated_params"] > base["memory"]["state_bytes"]["replicated_params"]
    gathered = lambda plan: sum(c["bytes_per_rank"] for c in plan["collectives"]  # noqa: E731
                                if c["name"] == "fsdp all-gather")
    assert gathered(out) < gathered(base)
    assert any(c["name"] == "ep all-to-all" for c in out["collectives"])


def test_search_json(monkeypatch):
    out = json.loads(run([*DEBUG, "--gpus", "2", "--search", "--json", "--ac", "none,full", "--top", "50"]))
    assert out["schema"] == SEARCH_SCHEMA and out["gpus"] == 2
    # on 2 ranks: dp_shard 2 (ep 1, 2), dp_replicate 2, cp 2 (ep 1, 2), tp 2; the trainer accepts every one
    assert out["candidates"] == 6 and out["rejected_by_trainer"] == 0
    assert out["planned"] == 2 * out["candidates"]  # two AC modes each
    speeds = [p["time"]["tokens_per_s"] for p in out["top"]]
    assert speeds == sorted(speeds, reverse=True) and all(p["memory"]["fits"] for p in out["top"])
    assert all(p["trainer_accepts"] for p in out["top"])
    layouts = {(p["layout"]["dp_replicate"], p["layout"]["dp_shard"], p["layout"]["tp"], p["layout"]["ep"],
                p["layout"]["cp"]) for p in out["top"]}
    assert {(1, 1, 1, 1, 2), (1, 1, 1, 2, 2)} <= layouts  # context-parallel layouts are searched


def test_expert_fsdp_shards_the_experts():
    """parallelism.expert_fsdp (default true): on 4 ranks with ep 2 each expert set is held by two ranks, which keep
    half its rows each (half the expert bytes of whole experts), gather them in the experts' op and reduce-scatter
    their gradients, on the critical path; `--parallelism.expert_fsdp false` keeps them whole and all-reduces."""
    layout = ["--parallelism.expert_parallel_degree", "2"]
    sharded = json.loads(run([*DEBUG, "--gpus", "4", "--json", *layout]))
    whole = json.loads(run([*DEBUG, "--gpus", "4", "--json", *layout, "--parallelism.expert_fsdp", "false"]))
    assert sharded["design"] == whole["design"] == "parallelize.py"
    assert sharded["layout"]["expert_fsdp"] and not whole["layout"]["expert_fsdp"]
    assert sharded["memory"]["state_bytes"]["params"] < whole["memory"]["state_bytes"]["params"]
    names = {c["name"]: c for c in sharded["collectives"]}
    assert names["expert all-gather"]["group"] == 2 and not names["expert all-gather"]["overlapped"]
    assert "expert reduce-scatter" in names and "expert grad all-reduce" not in names
    assert sharded["time"]["exposed_comm_s"]["expert all-gather"] > 0
    assert any(c["name"] == "expert grad all-reduce" for c in whole["collectives"])
    assert not any(c["name"].startswith("expert all-gather") for c in whole["collectives"])


def test_full_config_layout_on_64_h200(monkeypatch, tmp_path):
    """glm5_3_flash.toml's [parallelism] is accepted by the trainer on 64 ranks, and its comment's figures are the
    planner's: it fits with the experts sharded (expert_fsdp, the default), and does not with them whole."""
    import re

    from torchtitan_glm.planner import Request, plan
    from torchtitan_glm.planner.hardware import GIB, H200

    flash = "train_configs/glm5_3_flash.toml"
    (tmp_path / "tokens.bin").write_bytes(b"\0" * 64)  # its data path is a placeholder for the cluster's file
    monkeypatch.setenv("WORLD_SIZE", "64")
    cfg = load_config(["--config", flash, f"--data.paths={tmp_path / 'tokens.bin'}"])
    dims, _ = check_layout(cfg)
    assert (dims.dp_shard, dims.ep, dims.cp, dims.tp, cfg.parallelism.expert_fsdp) == (64, 32, 1, 1, True)
    monkeypatch.delenv("WORLD_SIZE")
    stated_plan = plan(Request(("--config", flash), 64, H200))
    assert stated_plan.verdict.accepted and stated_plan.fits and stated_plan.layout.experts_sharded
    whole = plan(Request(("--config", flash, "--parallelism.expert_fsdp", "false"), 64, H200))
    assert not whole.fits
    comment = (ROOT / flash).read_text()
    stated = re.search(r"peak ([\d.]+) GiB allocated, reserve\n# estimate ([\d.]+) GiB of [\d.]+ \(fits within 90%\); "
                       r"step ([\d.]+) s, ([\d,]+) tokens/s, estimated MFU ([\d.]+)%", comment)
    assert stated, "the [parallelism] comment's figures"
    peak, reserve, step, tps, mfu = stated.groups()
    got = stated_plan
    assert (float(peak), float(reserve)) == (round(got.memory.peak / GIB, 1), round(got.memory.reserved / GIB, 1))
    assert float(step) == round(got.time.step_s, 2) and int(tps.replace(",", "")) == round(got.time.tokens_per_s)
    assert float(mfu) == round(100 * got.time.mfu, 1)
    assert f"{whole.memory.peak / GIB:.1f} GiB peak per GPU" in comment.replace("\n# ", " ")


@pytest.mark.long
def test_128k_config_layout_on_64_h200(monkeypatch, tmp_path):
    """glm5_3_flash_128k.toml: 131,072-token rows over cp = 16 ranks; the trainer accepts its layout on 64 ranks, the
    planner says it fits, its header's figures are the planner's, and the 128K search ranks it first."""
    import re

    from torchtitan_glm.planner import Request, plan, search
    from torchtitan_glm.planner.hardware import GIB, H200

    long_ctx = "train_configs/glm5_3_flash_128k.toml"
    (tmp_path / "tokens.bin").write_bytes(b"\0" * 64)
    monkeypatch.setenv("WORLD_SIZE", "64")
    cfg = load_config(["--config", long_ctx, f"--data.paths={tmp_path / 'tokens.bin'}"])
    dims, _ = check_layout(cfg)
    assert cfg.training.seq_len == 131072 and cfg.activation_checkpoint.mode == "full"
    assert (dims.dp_shard, dims.cp, dims.ep, dims.tp) == (4, 16, 32, 1)
    monkeypatch.delenv("WORLD_SIZE")
    got = plan(Request(("--config", long_ctx), 64, H200))
    assert got.verdict.accepted and got.fits
    header = (ROOT / long_ctx).read_text().replace("\n# ", " ")
    stated = re.search(r"full AC: ([\d.]+) GiB allocated peak, reserve estimate ([\d.]+) GiB of [\d.]+ \(fits within "
                       r"90%\); step ([\d.]+) s for 4 rows \(([\d,]+) tokens\), ([\d,]+) tokens/s, estimated MFU "
                       r"([\d.]+)%", header)
    assert stated, "the header's figures"
    peak, reserve, step, tokens, tps, mfu = stated.groups()
    assert (float(peak), float(reserve)) == (round(got.memory.peak / GIB, 1), round(got.memory.reserved / GIB, 1))
    assert float(step) == round(got.time.step_s, 1) and int(tps.replace(",", "")) == round(got.time.tokens_per_s)
    assert int(tokens.replace(",", "")) == got.time.tokens_per_step and float(mfu) == round(100 * got.time.mfu, 1)
    best = search(Request(("--config", long_ctx), 64, H200), regimes=("full", "selective"))["top"][0]
    assert best.layout == got.layout and best.regime == "full"


def test_layout_overrides_reach_the_trainer_whole():
    """A layout key set back to its default on the command line is what the trainer checks, not the config's value:
    debug_model_ep.toml says ep = 2, which cp = 4 would reject; with ep = 1 the layout is valid."""
    ep_config = ["--config", "train_configs/debug_model_ep.toml"]
    layout = ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.context_parallel_degree", "4"]
    with pytest.raises(ConfigError, match="multiple of context_parallel_degree"):
        run([*ep_config, "--gpus", "4", *layout])
    out = json.loads(run([*ep_config, "--gpus", "4", "--json", *layout, "--parallelism.expert_parallel_degree", "1"]))
    assert out["trainer_accepts"] and out["layout"]["ep"] == 1 and out["layout"]["cp"] == 4


@pytest.mark.parametrize("name", ["AdamW", "AdamW8bit", "AdamWFp8"])
def test_optimizer_state_follows_optimizer_name(name):
    """The planned optimizer state of one rank is what the trainer's start-up summary counts for that optimizer
    (both moments; the low-bit ones 1 byte a value plus block scales) plus the step counters; cpu_offload is
    refused, naming the key."""
    from torchtitan_glm.components.optimizer import optimizer_state_bytes
    from torchtitan_glm.planner.core import PlanError, Request, build_inventory, load_request
    from torchtitan_glm.planner.hardware import H200
    from torchtitan_glm.planner.layout import resolve_layout
    from torchtitan_glm.planner.model import build_meta_model
    from torchtitan_glm.planner.params import STEP_BYTES, state_bytes

    argv = ("--config", "train_configs/glm5_3_flash_proxy.toml", "--optimizer.name", name)
    cfg, fields, _ = load_request(Request(argv, 1, H200))
    inv = build_inventory(cfg, scope="train")
    planned = state_bytes(inv, resolve_layout(fields, gpus=1, config=cfg.parallelism))
    model, _ = build_meta_model(cfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert planned.optimizer == optimizer_state_bytes(model, cfg.optimizer) + STEP_BYTES * len(trainable)
    elements = sum(p.numel() for p in trainable)
    per_element = planned.optimizer / elements
    assert per_element == pytest.approx(8.0 if name == "AdamW" else 2.03, rel=0.01), per_element
    with pytest.raises(PlanError, match="optimizer.cpu_offload"):
        offload = (*argv[:2], "--optimizer.name", "AdamW", "--optimizer.cpu_offload", "true")
        build_inventory(load_request(Request(offload, 1, H200))[0], scope="train")


def test_recompute_modules_move_the_plan():
    # Each label drops saved outputs (checked against captures in test_planner_activations.py) and costs its
    # forward once more: the plan keeps less and takes longer; without the key, no recompute term. At T = 16K the
    # peak is in backward, where activations bind (at 4K, with FSDP2's reduce in the compute pool, it is the last
    # reduce, after the activations are gone).
    base = ["--config", "train_configs/glm5_3_flash_proxy.toml", "--gpus", "1", "--activation_checkpoint.mode",
            "selective", "--training.seq_len", "16384", "--json"]
    plain = json.loads(run(base))
    assert "recompute_modules" not in plain["time"]["compute_s"]
    for labels in ("kda", "kda,mhc,indexer,mla_up_proj,sparse_attn,moe,mlp"):
        more = json.loads(run(base + ["--activation_checkpoint.recompute_modules", labels]))
        assert more["time"]["compute_s"]["recompute_modules"] > 0
        assert more["time"]["tokens_per_s"] < plain["time"]["tokens_per_s"]
        assert more["memory"]["reserved_gib"] < plain["memory"]["reserved_gib"], labels
        assert (sum(more["memory"]["activation_terms_gib"].values())
                < sum(plain["memory"]["activation_terms_gib"].values()))


@pytest.mark.parametrize("mode,reruns", [("none", 0), ("selective", 1), ("full", 1)])
def test_expert_time_counts_the_forwards_that_ac_and_moe_chunks_re_run(mode, reruns):
    """The routed experts' GEMM time is forward + backward (3 forwards' worth) plus one forward per re-run: AC's
    (selective recomputes the routed experts too) and moe_chunk_tokens' (each chunk's backward re-runs its chunk;
    tests/unit/test_recompute_modules.py counts them on the model)."""
    proxy = ["--config", "train_configs/glm5_3_flash_proxy.toml", "--gpus", "1", "--json",
             "--activation_checkpoint.mode", mode]
    plain = json.loads(run(proxy))["time"]["compute_s"]["expert_gemm"]
    chunked = json.loads(run([*proxy, "--activation_checkpoint.moe_chunk_tokens", "512"]))["time"]["compute_s"]
    assert chunked["expert_gemm"] == pytest.approx(plain * (4 + reruns) / (3 + reruns), rel=1e-3)


def test_what_if_names_the_trainers_reason_for_a_layout_of_the_wrong_size(monkeypatch):
    """tp = 3 does not divide 2 GPUs: --what-if cannot plan it either, and says why as the trainer does (not 'the
    layout ... dp_shard=0 ... uses 0 GPUs')."""
    layout = ["--parallelism.tensor_parallel_degree", "3"]
    message = _trainer_error([*DEBUG, *layout], 2, monkeypatch)
    for what_if in ([], ["--what-if"]):
        with pytest.raises(ConfigError) as err:
            run([*DEBUG, "--gpus", "2", *what_if, *layout])
        assert str(err.value) == message


def test_device_memory_limit_is_the_plans_budget():
    """training.device_memory_limit_gib below MEMORY_BUDGET of the card becomes the budget the plan is held to (and
    can fail it); a limit above that share leaves the budget alone. The planner plans it on a host without the card."""
    proxy = ["--config", "train_configs/glm5_3_flash_proxy.toml", "--gpus", "1", "--json"]
    free = json.loads(run(proxy))
    assert free["memory"]["budget_gib"] == pytest.approx(0.9 * free["memory"]["capacity_gib"], abs=0.01)
    limited = json.loads(run([*proxy, "--training.device_memory_limit_gib", "20"]))
    assert limited["memory"]["budget_gib"] == 20 and not limited["memory"]["fits"]
    assert limited["memory"]["peak_gib"] == free["memory"]["peak_gib"]
    loose = json.loads(run([*proxy, "--training.device_memory_limit_gib", "139"]))
    assert loose["memory"]["budget_gib"] == free["memory"]["budget_gib"]


def test_device_memory_limit_above_the_card_is_refused_naming_the_key():
    """As train.py refuses it on that card (exit 2 from the script), for a plan and for a search."""
    for extra in ([], ["--search"]):
        with pytest.raises(ConfigError, match=r"training.device_memory_limit_gib.*is 200 GiB and the device has"):
            run(["--config", "train_configs/glm5_3_flash_proxy.toml", "--gpus", "1", *extra,
                 "--training.device_memory_limit_gib", "200"])


def test_document_masking_false_plans_one_causal_sequence_per_row():
    """data.document_masking false: the rows have no document ids. The proxy's DSA rows at T = 4,096 (at most
    dsa_dense_max_len: masked SDPA in query chunks) then run their first index_topk + kpool - 1 queries in the causal
    kernel, at its rate; in the dense stage every row does and no [T, T] mask is kept (one byte per pair, per DSA
    block: the two DSA layers and the MTP layer). Under context parallelism the rows keep ids: nothing changes."""
    from torchtitan_glm.ops.masked_attention import masked_keys_per_query
    from torchtitan_glm.planner.hardware import H200

    base = ["--config", "train_configs/glm5_3_flash_proxy.toml", "--gpus", "1", "--json",
            "--activation_checkpoint.mode", "none"]
    seq, chunk = 4096, 1024
    args = build_model_args(load_config(base[:2]))
    assert args.dense_dsa_kernel(seq) and args.dsa_mask_query_chunk == chunk and args.num_dsa_layers == 2

    def plan(*extra: str) -> dict:
        return json.loads(run([*base, *extra]))

    def attention_s(causal_rows: int) -> float:
        masked, causal = masked_keys_per_query(seq, chunk, causal_rows)
        return masked / H200.attention_masked + causal / H200.attention_causal

    for stage, rows in (([], args.index_topk + args.index_kpool - 1), (["--loss.indexer_stage", "dense_warmup"], seq)):
        packed, one = plan(*stage), plan(*stage, "--data.document_masking", "false")
        ratio = one["time"]["compute_s"]["dsa_attention"] / packed["time"]["compute_s"]["dsa_attention"]
        assert ratio == pytest.approx(attention_s(rows) / attention_s(0), rel=1e-3), stage
        terms = packed["memory"]["activation_terms_gib"], one["memory"]["activation_terms_gib"]
        kept = terms[0]["attention"] - terms[1]["attention"]
        mask = 3 * seq * seq / 2**30 if stage else 0.0  # the sparse stage still forms the selection's mask
        assert kept == pytest.approx(mask, abs=2e-3), stage
    cp = ["--parallelism.context_parallel_degree", "2", "--gpus", "2", "--parallelism.data_parallel_shard_degree", "1"]
    with_ids, without = plan(*cp), plan(*cp, "--data.document_masking", "false")
    assert (with_ids["time"], with_ids["memory"]) == (without["time"], without["memory"])


def test_fp8_time_adds_per_gemm_and_its_bound_is_the_bf16_plans():
    """With FP8 the dense projections Float8Linear converts run at the measured speed-up and the rest at the BF16
    rate, so their times add (the BF16 plan's dense time = the kept part + the converted part x the speed-up; a
    blended rate would plan FP8 faster), and the routed experts at the FP8 grouped kernels' speed-up plus their
    casts, a term of its own. The FP8 line's speed-up is the BF16 plan's step over this one, and its bounds hold the
    rest of the step fixed."""
    from torchtitan_glm.planner.hardware import H200

    base = ["--config", "train_configs/glm5_3_flash_proxy.toml", "--gpus", "1", "--json", "--scope", "bench_train"]
    bf16 = json.loads(run(base))["time"]
    fp8 = json.loads(run([*base, "--float8.enable", "true"]))["time"]
    assert bf16["fp8"] is None and bf16["compute_s"]["dense_gemm_fp8"] == 0
    c, b = fp8["compute_s"], bf16["compute_s"]
    assert 0 < c["dense_gemm_fp8"] and 0 < c["dense_gemm"] < b["dense_gemm"]
    assert c["dense_gemm"] + c["dense_gemm_fp8"] * H200.fp8_speedup_tensorwise == pytest.approx(b["dense_gemm"],
                                                                                                rel=1e-3)
    assert c["expert_gemm"] * H200.fp8_speedup_grouped == pytest.approx(b["expert_gemm"], rel=1e-3)
    assert "expert_fp8_casts" not in b and c["expert_fp8_casts"] > 0
    bound = fp8["fp8"]
    assert bound["speedup"] == pytest.approx(bf16["step_s"] / fp8["step_s"], rel=1e-3)
    converted_bf16 = b["dense_gemm"] - c["dense_gemm"] + b["expert_gemm"]
    assert bound["converted_bf16_s"] == pytest.approx(converted_bf16, rel=1e-3)
    assert bound["converted_s"] == pytest.approx(c["dense_gemm_fp8"] + c["expert_gemm"] + c["expert_fp8_casts"],
                                                 rel=1e-3)
    rest = bf16["step_s"] - converted_bf16
    assert bound["speedup_at_2x"] == pytest.approx(bf16["step_s"] / (rest + converted_bf16 / 2), rel=1e-3)
    assert bound["speedup_if_free"] == pytest.approx(bf16["step_s"] / rest, rel=1e-3)
    assert bound["speedup"] < bound["speedup_at_2x"] < bound["speedup_if_free"]
    # what the routed experts in FP8 cost over BF16, and the text's hint when that is positive (the proxy at 4,096
    # tokens: 1,024 rows per expert)
    net = c["expert_gemm"] + c["expert_fp8_casts"] - b["expert_gemm"]
    assert bound["experts_net_s"] == pytest.approx(net, abs=2e-5) and net > 0
    text = run(base[:-3] + ["--scope", "bench_train", "--float8.enable", "true"])
    assert "float8.moe_experts = false plans faster" in text
    dense_only = json.loads(run([*base, "--float8.enable", "true", "--float8.moe_experts", "false"]))["time"]["fp8"]
    assert "experts_net_s" not in dense_only
    assert "plans faster" not in run(base[:-3] + ["--scope", "bench_train", "--float8.enable", "true",
                                                   "--float8.moe_experts", "false"])


def test_expert_fp8_casts_count_every_tensor_torchao_casts():
    """The routed experts' FP8 cast bytes against an enumeration of the tensors torchao's rowwise grouped GEMM casts
    (prototype/moe_training/fp8_grouped_mm.py: each read in BF16 and written in E4M3; the backward's weight cast
    reads the weight twice, scales then cast), per MoE layer. The weights' share is per call and per EP rank's
    experts, the rows' share per token; the proxy's 5 MoE layers at 4,096 tokens move 50.33 GB, the figure
    hardware.H200's cast rate was derived from."""
    from torchtitan_glm.models.glm5.args import get_flavor
    from torchtitan_glm.planner.timing import expert_fp8_cast_bytes

    a = get_flavor("glm5_3_flash_proxy")
    n, d, f, e = 4096 * a.num_experts_per_tok, a.hidden_size, a.moe_intermediate_size, a.n_routed_experts
    x, h, w = n * d, n * f, e * d * f  # a [N, d] input, a [N, F] one, one weight [E, d, F]
    forward = 3 * ((x + x + h) + 3 * w)  # gate, up and down inputs rowwise; each weight per output column
    # output gradients rowwise; the wgrad pairs per group; each weight per input row (read twice: 5 bytes)
    backward = 3 * ((h + h + x) + (h + x) * 3) + 5 * 3 * w
    assert expert_fp8_cast_bytes(a, tokens=4096, ep=1, calls=1, forwards=1) == forward + backward
    assert 5 * expert_fp8_cast_bytes(a, tokens=4096, ep=1, calls=1, forwards=1) == pytest.approx(50.33e9, rel=1e-3)
    # a recomputed forward adds the forward's casts; EP ranks cast only their experts; chunks re-cast the weights
    assert expert_fp8_cast_bytes(a, tokens=4096, ep=1, calls=1, forwards=2) == 2 * forward + backward
    assert expert_fp8_cast_bytes(a, tokens=4096, ep=4, calls=1, forwards=1) == forward + backward - 24 * w + 6 * w
    assert expert_fp8_cast_bytes(a, tokens=4096, ep=1, calls=2, forwards=1) == forward + backward + 24 * w


@pytest.mark.parametrize("argv", [
    # recomputed projections: KDA's stay BF16 under the serving split, the MLPs' and shared experts' are converted
    ["--config", "train_configs/glm5_3_flash_proxy.toml", "--gpus", "1", "--activation_checkpoint.mode", "selective",
     "--activation_checkpoint.recompute_modules", "kda,mlp,moe"],
    # 64 GPUs: less compute under FP8 leaves more of FSDP2's collectives exposed
    ["--config", "train_configs/glm5_3_flash.toml", "--gpus", "64"],
])
def test_fp8_speedup_is_the_ratio_of_the_two_plans(argv):
    """The FP8 line's planned speed-up is the BF16 plan's step over the FP8 plan's, wherever FP8 changes more than
    the converted GEMMs' own terms: recompute_modules (only converted roles get faster) and exposed communication."""
    bf16 = json.loads(run([*argv, "--json", "--float8.enable", "false"]))["time"]
    fp8 = json.loads(run([*argv, "--json", "--float8.enable", "true"]))["time"]
    assert fp8["fp8"]["speedup"] == pytest.approx(bf16["step_s"] / fp8["step_s"], rel=1e-4)
    if "--activation_checkpoint.recompute_modules" in argv:
        kept = json.loads(run([*argv[:-1], "kda", "--json", "--float8.enable", "true"]))["time"]["compute_s"]
        bf16_kept = json.loads(run([*argv[:-1], "kda", "--json", "--float8.enable", "false"]))["time"]["compute_s"]
        assert kept["recompute_modules"] == pytest.approx(bf16_kept["recompute_modules"], rel=1e-6)
        assert kept.get("recompute_modules_fp8", 0) == 0 < fp8["compute_s"]["recompute_modules_fp8"]


def test_expert_parallel_backward_reruns_the_experts_forward():
    """Under EP the experts' op re-runs the local experts in its backward (ops/expert_parallel.py ep_swiglu_bwd), so
    the routed-expert GEMMs cost a fourth forward's worth more per token than without EP (no AC here), and with FP8
    their casts repeat the forward's; the tokens per rank are the same on both layouts."""
    from torchtitan_glm.planner.timing import expert_fp8_cast_bytes

    base = ["--config", "train_configs/debug_model_ep.toml", "--model.flavor", "glm5_3_flash_proxy"]
    no_ep = ["--parallelism.expert_parallel_degree", "1"]
    fp8 = ["--float8.enable", "true"]

    def compute(*extra):
        from torchtitan_glm.planner import Request, plan
        from torchtitan_glm.planner.hardware import H200

        return plan(Request((*base, *extra), 2, H200)).time.compute_s

    ep, single = compute(), compute(*no_ep)
    assert ep["expert_gemm"] == pytest.approx(single["expert_gemm"] * (1 + 1 / 3), rel=1e-9)
    ep8, single8 = compute(*fp8), compute(*fp8, *no_ep)
    cfg = load_config(base)
    args, tokens = build_model_args(cfg), cfg.training.seq_len * cfg.training.local_batch_size
    ratio = (expert_fp8_cast_bytes(args, tokens=tokens, ep=2, calls=1, forwards=2)
             / expert_fp8_cast_bytes(args, tokens=tokens, ep=1, calls=1, forwards=1))
    assert ep8["expert_fp8_casts"] / single8["expert_fp8_casts"] == pytest.approx(ratio, rel=1e-9)


def test_script_prints_no_known_benign_library_warnings():
    """plan.py filters what init_logging filters for train.py before torchao is imported: torchao's prebuilt
    extensions failing to load against this torch, and torch's pytree Enum note, read as errors by a reviewer."""
    res = subprocess.run([sys.executable, "scripts/plan.py", *DEBUG, "--gpus", "1"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={k: v for k, v in os.environ.items()
                                                      if k != "TORCHAO_FORCE_SKIP_LOADING_SO_FILES"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Failed to load" not in res.stderr and "register_constant" not in res.stderr, res.stderr[-3000:]
