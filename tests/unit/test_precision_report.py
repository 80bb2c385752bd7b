"""scripts/precision_report.py on the full GLM-5.3-Flash config: every parameter's (role, precision) equals the
serving split as stated from the architecture (names are fine here: the test is the independent statement), with
the counts of each kind, and the FP8 FLOP share the text form ends with; the JSON form has the documented schema; the
start-up counts match the converted modules."""

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from torchtitan_glm.components.metrics import flops_per_token
from torchtitan_glm.config import load_config
from torchtitan_glm.float8 import convert_float8, float8_linear_class
from torchtitan_glm.models.glm5 import Glm5Model, get_flavor
from torchtitan_glm.train import build_model_args

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from precision_report import report  # noqa: E402

KDA_PROJ = r"(q|k|v|f_a|f_b|g_a|g_b|b|o)_proj\.weight"
MLA_PROJ = r"(q_a|q_b|kv_a|kv_b|o)_proj(_with_mqa)?\.weight"


def expected(fqn: str) -> tuple[str, str]:
    """The split of issue 8 for the full model, from the checkpoint layout."""
    m = re.match(r"(layers\.(\d+)|mtp)\.(.*)$", fqn)
    if m is None:
        return {"embed_tokens.weight": ("embedding", "bf16"), "lm_head.weight": ("lm_head", "bf16"),
                "norm.weight": ("norm", "bf16")}[fqn]
    layer, rest = m.group(2), m.group(3)
    is_kda = layer is not None and int(layer) % 4 != 3
    rules = [
        (r"(attn|ffn)_hc\.(fn|base|scale)", ("mhc", "fp32")),
        (r"(input_layernorm|post_attention_layernorm|enorm|hnorm|shared_head\.norm)\.weight", ("norm", "bf16")),
        (r"self_attn\.(q_a_layernorm|kv_a_layernorm|o_norm)\.weight", ("norm", "bf16")),
        (r"self_attn\.decay\.(A_log|dt_bias)", ("kda_decay", "fp32")),
        (r"self_attn\.(q|k|v)_conv1d\.weight", ("short_conv", "fp32")),
        (r"self_attn\.indexer\.(wq_b\.weight|wk\.weight|weights_proj\.weight|index_kpool_compress_gate)",
         ("indexer", "bf16")),
        (r"self_attn\.indexer\.k_norm\.(weight|bias)", ("indexer", "fp32")),
        (r"self_attn\.indexer\.kpool_ape\.weight", ("kpool_ape", "fp32")),
        (r"mlp\.gate\.weight", ("router", "fp32")),
        (r"mlp\.experts\.(gate|up|down)_proj", ("experts", "fp8-grouped-rowwise")),
        (r"mlp\.shared_experts\.(gate|up|down)_proj\.weight", ("shared_expert", "fp8-rowwise")),
        (r"mlp\.(gate|up|down)_proj\.weight", ("mlp", "fp8-rowwise")),
        (r"eh_proj\.weight", ("mtp", "fp8-rowwise")),
        (rf"self_attn\.{KDA_PROJ}", ("kda", "bf16") if is_kda else None),
        (rf"self_attn\.{MLA_PROJ}", ("mla", "bf16") if not is_kda else None),
    ]
    for pattern, want in rules:
        if re.fullmatch(pattern, rest) and want is not None:
            return want
    raise AssertionError(f"no rule for {fqn}")


def test_full_model_report_is_the_serving_split():
    rows, share, line, _ = report(["--config", str(ROOT / "train_configs/glm5_3_flash.toml")])
    with torch.device("meta"):
        names = [n for n, _ in Glm5Model(get_flavor("glm5_3_flash")).named_parameters()]
    assert [r["fqn"] for r in rows] == names
    for r in rows:
        assert (r["role"], r["precision"]) == expected(r["fqn"]), r
    counts = Counter((r["role"], r["precision"]) for r in rows)
    kda, dsa, moe = 34, 11 + 1, 42 + 1  # DSA and MoE include the MTP layer's
    assert counts[("kda", "bf16")] == 9 * kda and counts[("short_conv", "fp32")] == 3 * kda
    assert counts[("mla", "bf16")] == 5 * dsa and counts[("indexer", "bf16")] == 4 * dsa
    assert counts[("kpool_ape", "fp32")] == dsa and counts[("router", "fp32")] == moe
    assert counts[("experts", "fp8-grouped-rowwise")] == 3 * moe == counts[("shared_expert", "fp8-rowwise")]
    assert counts[("mlp", "fp8-rowwise")] == 3 * 3 and counts[("mhc", "fp32")] == 45 * 2 * 3
    assert line == (f"float8: recipe=rowwise, converted {3 * 3 + 3 * moe + 1} Linear, {3 * moe} grouped-expert "
                    f"weights; kept BF16 by role: indexer={3 * dsa}, mla={5 * dsa}, kda={9 * kda}")
    # the FP8 FLOP share, from the architecture: 6 FLOPs per token per active FP8 weight element (3 dense MLPs; 43
    # MoE layers, each its shared expert and 8 of 288 routed experts; the MTP's [2D -> D] projection) over the
    # trainer's FLOPs per token at the config's T
    cfg = load_config(["--config", str(ROOT / "train_configs/glm5_3_flash.toml"), "--data.source=builtin",
                       "--data.paths=", "--data.tokenizer=byte"])
    args = build_model_args(cfg)
    d = args.hidden_size
    active = 3 * 3 * d * args.intermediate_size + moe * (1 + 8) * 3 * d * args.moe_intermediate_size + 2 * d * d
    assert share == pytest.approx(6 * active / flops_per_token(args, cfg.training.seq_len), rel=1e-12)


def test_report_text_ends_with_the_fp8_flop_share():
    res = _script("--config", "train_configs/glm5_3_flash.toml")
    assert res.returncode == 0, res.stderr
    _, share, line, _ = report(["--config", str(ROOT / "train_configs/glm5_3_flash.toml")])
    lines = res.stdout.splitlines()
    assert line in lines and lines[-1] == f"share of training FLOPs in FP8: {100 * share:.1f}%"


def test_report_json_schema():
    res = subprocess.run([sys.executable, "scripts/precision_report.py", "--config", "train_configs/debug_model.toml",
                          "--float8.enable", "true", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    assert rows and all(set(r) == {"fqn", "role", "precision"} for r in rows)
    assert {r["precision"] for r in rows} <= {"fp8-tensorwise", "fp8-rowwise", "fp8-grouped-rowwise", "bf16", "fp32"}


def test_startup_counts_match_converted_modules_and_zero_when_off():
    cfg = load_config(["--float8.enable", "true", "--float8.keep_bf16", "kda"])
    model = Glm5Model(get_flavor("debug"))
    summary = convert_float8(model, cfg=cfg.float8)
    f8 = float8_linear_class()
    assert summary.converted_linears == sum(isinstance(m, f8) for m in model.modules()) > 0
    converted_roles = {type(m).__name__ for m in model.modules() if isinstance(m, f8)}
    assert converted_roles == {"Float8Linear"}
    # the indexer and MLA are convertible once only kda is kept (their dims divide by 16 in the debug flavor)
    mla = model.layers["3"].self_attn
    assert isinstance(mla.q_b_proj, f8) and isinstance(mla.indexer.wk, f8)
    assert not isinstance(model.layers["0"].self_attn.o_proj, f8)
    assert summary.kept_bf16 == {"indexer": 0, "mla": 0, "kda": 27} and summary.grouped_expert_weights == 12
    # what an FP8 role left BF16, counted from the model: every non-kda Linear that is not a Float8Linear
    from torchtitan_glm.float8 import linear_roles

    modules = dict(model.named_modules())
    left = Counter(r for fqn, r in linear_roles(model).items() if r != "kda" and not isinstance(modules[fqn], f8))
    assert left and summary.left_bf16 == dict(left)
    head = (f"float8: recipe=tensorwise, converted {summary.converted_linears} Linear, 12 grouped-expert weights; "
            "kept BF16 by role: indexer=0, mla=0, kda=27")
    assert summary.line() == (f"{head}; left BF16 although their role runs FP8 (a dim not divisible by 16, or read "
                              f"only through its weight): {sum(left.values())} Linear ("
                              + ", ".join(f"{r}={n}" for r, n in sorted(left.items())) + ")")
    # float8 off: the same one-line format, nothing converted, every serving-role Linear BF16
    plain = Glm5Model(get_flavor("debug"))
    n = Counter(linear_roles(plain).values())
    assert convert_float8(plain, cfg=load_config([]).float8).line() == (
        "float8: recipe=off, converted 0 Linear, 0 grouped-expert weights; kept BF16 by role: "
        f"indexer={n['indexer']}, mla={n['mla']}, kda={n['kda']}")


def test_experts_left_bf16_by_the_shape_rule_are_reported():
    cfg = load_config(["--float8.enable", "true"])
    model = Glm5Model(get_flavor("debug").replace(moe_intermediate_size=24))
    summary = convert_float8(model, cfg=cfg.float8)
    assert summary.grouped_expert_weights == 0 and summary.experts_left_bf16 == 4  # 3 MoE layers + the MTP's
    assert summary.line().endswith("left BF16 although their role runs FP8 (a dim not divisible by 16, or read only "
                                   "through its weight): 12 Linear (shared_expert=12), 4 routed-expert modules")
    assert "left BF16" not in convert_float8(Glm5Model(get_flavor("debug")), cfg=load_config([]).float8).line()
    assert summary.nothing_converted() == ""  # the Linears still converted
    # hidden 72: no FP8 role's Linear nor expert divisible by 16, so FP8 on trains BF16, and says so
    empty = convert_float8(Glm5Model(get_flavor("debug").replace(hidden_size=72)), cfg=cfg.float8)
    assert (empty.converted_linears, empty.grouped_expert_weights) == (0, 0)
    assert "no Linear and no routed expert was converted" in empty.nothing_converted()
    assert convert_float8(Glm5Model(get_flavor("debug")), cfg=load_config([]).float8).nothing_converted() == ""
    # the report prints the line train.py prints at start-up, what was left BF16 included
    _, _, line, _ = report(["--config", str(ROOT / "train_configs/debug_model.toml"), "--float8.enable", "true",
                            "--model.moe_intermediate_size", "24"])
    assert line == summary.line()


def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/precision_report.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_help_is_the_scripts_own():
    res = _script("--help")
    assert res.returncode == 0, res.stderr
    usage = res.stdout.splitlines()[0]
    assert usage.startswith("usage: precision_report.py") and "--json" in usage, usage
    assert "train.py's config keys" in res.stdout and "usage: train.py" not in res.stdout


@pytest.mark.long
def test_indexer_weights_fp32_keeps_the_bf16_rows_and_says_the_matmul_is_fp32():
    config = ["--config", str(ROOT / "train_configs/glm5_3_flash.toml")]
    rows, _, _, notes = report([*config, "--model.indexer_weights_fp32", "true"])  # the config's value, said here
    proj = [r for r in rows if r["fqn"].endswith("indexer.weights_proj.weight")]
    assert proj and all((r["role"], r["precision"]) == ("indexer", "bf16") for r in proj)
    assert len(notes) == 1 and f"({len(proj)} Linear)" in notes[0], notes
    assert "weights BF16" in notes[0] and "matmul in FP32" in notes[0] and "model.indexer_weights_fp32" in notes[0]
    res = _script(*config, "--model.indexer_weights_fp32", "true")
    assert res.returncode == 0 and notes[0] in res.stdout.splitlines(), res.stderr[-2000:]
    off = _script(*config, "--model.indexer_weights_fp32", "false")
    assert off.returncode == 0 and "matmul in FP32" not in off.stdout, off.stderr[-2000:]
    assert report([*config, "--model.indexer_weights_fp32", "false"])[3] == []
    as_json = _script(*config, "--model.indexer_weights_fp32", "true", "--json")
    assert as_json.returncode == 0 and json.loads(as_json.stdout) == rows
