"""[float8] and the Glm5ModelArgs keys of [model]: valid combinations load, bad ones raise ConfigError naming the key,
and --print-config round-trips the model overrides."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchtitan_glm.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_float8_defaults_are_the_serving_split():
    cfg = load_config(["--float8.enable", "true"])
    assert cfg.float8.recipe == "tensorwise" and cfg.float8.moe_experts
    assert cfg.float8.keep_bf16 == ["indexer", "mla", "kda"]


@pytest.mark.parametrize("argv,key", [
    (["--float8.keep_bf16", "indexer,attention"], "float8.keep_bf16"),
    (["--float8.keep_bf16", "experts"], "float8.keep_bf16"),
    (["--float8.keep_bf16", "kda,kda"], "float8.keep_bf16"),
    (["--float8.recipe", "rowwise", "--float8.fsdp_float8_all_gather", "true"], "float8.fsdp_float8_all_gather"),
    (["--float8.recipe", "mxfp8"], "float8.recipe"),
    (["--model.hc_mult", "0"], "model.hc_mult"),
    (["--model.hc_mult", "two"], "model.hc_mult"),
    (["--model.mhc_fp32_mixing", "maybe"], "model.mhc_fp32_mixing"),
    (["--model.hc_head", "weighted"], "model.hc_head"),
    (["--model.index_head_dim", "24", "--model.indexer_fp8_emulation", "true"], "model.indexer_fp8_emulation"),
    (["--model.no_such_field", "1"], "model.no_such_field"),
    (["--model.dsa_attention", "dense"], "model.dsa_attention"),  # set by loss.indexer_stage
    # values the model cannot run (each crashed or trained on NaN before it was checked)
    (["--model.kv_lora_rank", "0"], "model.kv_lora_rank"),
    (["--model.n_group", "0"], "model.n_group"),
    (["--model.intermediate_size", "0"], "model.intermediate_size"),
    (["--model.moe_intermediate_size", "0"], "model.moe_intermediate_size"),
    (["--model.n_shared_experts", "0"], "model.n_shared_experts"),
    (["--model.v_head_dim", "0"], "model.v_head_dim"),
    (["--model.linear_conv_kernel_dim", "0"], "model.linear_conv_kernel_dim"),
    (["--model.max_position_embeddings", "-5"], "model.max_position_embeddings"),
    (["--model.first_k_dense_replace", "-1"], "model.first_k_dense_replace"),
    (["--model.rms_norm_eps", "-1"], "model.rms_norm_eps"),
    (["--model.routed_scaling_factor", "nan"], "model.routed_scaling_factor"),
    (["--model.initializer_range", "inf"], "model.initializer_range"),
    (["--model.moe_router_dtype", "garbage"], "model.moe_router_dtype"),
    (["--model.topk_method", "garbage"], "model.topk_method"),
    # the flavor alone is valid, so a lone override that breaks a rule elsewhere is the key to name
    (["--model.index_kpool", "3"], "model.index_kpool"),
    # accepted before and without effect (or, for tying, exported as tied while trained untied)
    (["--model.tie_word_embeddings", "true"], "model.tie_word_embeddings"),
    (["--model.index_kpool_compress", "false"], "model.index_kpool_compress"),
    (["--model.index_share_for_mtp_iteration", "false"], "model.index_share_for_mtp_iteration"),
    (["--model.router_aux_loss_coef", "0.5"], "model.router_aux_loss_coef"),  # the trainer's: loss.seq_aux_loss_coeff
    (["--training.seq_len", "128", "--model.max_position_embeddings", "16"], "training.seq_len"),
    # set by the trainer from [loss]: accepted before, then overridden without a word
    (["--model.indexer_tile_elements", "4096"], "model.indexer_tile_elements"),
    (["--loss.mtp_weight", "0", "--model.num_nextn_predict_layers", "1"], "model.num_nextn_predict_layers"),
])
def test_bad_keys_name_themselves(argv, key):
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    assert info.value.key == key, info.value


def test_model_overrides_reach_the_args_and_round_trip(tmp_path, capsys):
    argv = ["--model.mhc_fp32_mixing", "true", "--model.kpool_ape_trainable", "false", "--model.num_hidden_layers",
            "2", "--model.layer_types", "linear_attention,indexed_attention", "--model.linear_lower_bound", "none"]
    cfg = load_config(argv)
    args = cfg.model.model_args()
    assert args.mhc_fp32_mixing and not args.kpool_ape_trainable and args.num_hidden_layers == 2
    assert args.linear_lower_bound is None and args.layer_types == ["linear_attention", "indexed_attention"]
    with pytest.raises(SystemExit):
        load_config(argv + ["--print-config"])
    toml = capsys.readouterr().out
    path = tmp_path / "round.toml"
    path.write_text(toml)
    again = load_config(["--config", str(path)])
    assert again.model.args == {k: v for k, v in cfg.model.args.items() if v is not None}


def test_trainer_set_model_field_points_at_its_key():
    with pytest.raises(ConfigError) as info:
        load_config(["--model.dsa_attention", "dense"])
    assert "loss.indexer_stage" in str(info.value) and "did you mean" not in str(info.value)


def test_first_k_dense_replace_override_rederives_the_mlp_types():
    args = load_config(["--model.flavor", "glm5_3_flash_proxy",
                        "--model.first_k_dense_replace", "1"]).model.model_args()
    assert args.mlp_layer_types == ["dense"] + ["sparse"] * (args.num_hidden_layers - 1)
    given = ["sparse", "dense", "sparse", "sparse"]  # an explicit list still wins
    args = load_config(["--model.first_k_dense_replace", "2",
                        "--model.mlp_layer_types", ",".join(given)]).model.model_args()
    assert args.mlp_layer_types == given


def test_train_exits_2_naming_a_bad_float8_key():
    res = subprocess.run([sys.executable, "train.py", "--config", "train_configs/debug_model.toml",
                          "--float8.keep_bf16", "indexer,kda,moe"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2 and "float8.keep_bf16" in res.stderr and "'moe'" in res.stderr


def test_rowwise_on_a_cpu_torch_without_row_scales_names_the_recipe(monkeypatch):
    """torch 2.11's CPU _scaled_mm asserts on row-wise scales: the trainer's host check says so naming float8.recipe
    (exit 2 in main) instead; tensorwise and FP8 off still pass, and so does check_layout (which the planner runs for
    other machines). The probe agrees with what a rowwise Float8Linear does here."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    import torchtitan_glm.float8 as f8
    from torchtitan_glm.train import check_layout, check_this_host

    linear = torch.nn.Sequential(torch.nn.Linear(32, 16, bias=False, dtype=torch.bfloat16))
    convert_to_float8_training(linear, config=Float8LinearConfig.from_recipe_name("rowwise"))
    try:
        linear(torch.randn(16, 32, dtype=torch.bfloat16))
        works = True
    except RuntimeError:
        works = False
    assert f8.cpu_scaled_mm_takes_row_scales() == works
    monkeypatch.setattr(f8, "cpu_scaled_mm_takes_row_scales", lambda: False)
    for recipe in ("rowwise", "rowwise_with_gw_hp"):
        with pytest.raises(ConfigError, match=r"float8\.recipe.*row-wise scales"):
            check_this_host(load_config(["--float8.enable", "true", "--float8.recipe", recipe]))
        check_layout(load_config(["--float8.enable", "true", "--float8.recipe", recipe]))
    check_this_host(load_config(["--float8.enable", "true", "--float8.recipe", "tensorwise"]))
    check_this_host(load_config(["--float8.recipe", "rowwise"]))


def test_hf_config_of_another_model_type_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "num_key_value_heads": 8}')
    with pytest.raises(ConfigError) as info:
        load_config(["--model.hf_config", str(tmp_path)])
    assert info.value.key == "model.hf_config" and "not a glm5_next checkpoint" in str(info.value)


def test_startup_precision_line_names_the_split():
    from torchtitan_glm.components.logs import precision_line

    cfg = load_config(["--float8.enable", "true", "--float8.recipe", "rowwise"])
    line = precision_line(cfg.training, cfg.float8)
    assert "FP8 rowwise Linears, FP8 grouped experts, kept BF16: indexer, mla, kda" in line
    assert "FP8" not in precision_line(cfg.training, load_config([]).float8)
    # the converted model's experts, when given, win over the config: none, some or no FP8-convertible experts
    assert "FP8 rowwise Linears, FP8 grouped experts, kept" in precision_line(cfg.training, cfg.float8,
                                                                               expert_modules=(4, 4))
    assert "FP8 grouped experts (3 of 4 modules)" in precision_line(cfg.training, cfg.float8, expert_modules=(3, 4))
    assert "BF16 experts (float8.moe_experts, but no expert weight has dims divisible by 16)" in precision_line(
        cfg.training, cfg.float8, expert_modules=(0, 4))
    assert "no routed experts" in precision_line(cfg.training, cfg.float8, expert_modules=(0, 0))


def test_startup_summary_reads_the_experts_from_the_converted_model(tmp_path):
    """hidden_size 72 (not a multiple of 16): float8.moe_experts converts no expert, and the summary says so."""
    from torchtitan_glm.components.logs import startup_summary
    from torchtitan_glm.float8 import convert_float8
    from torchtitan_glm.models.glm5 import Glm5Model

    cfg = load_config(["--config", "train_configs/debug_model.toml", "--float8.enable", "true",
                       "--model.hidden_size", "72", f"--job.dump_folder={tmp_path}"])
    args = cfg.model.model_args()
    with torch.device("meta"):
        model = Glm5Model(args)
    summary = convert_float8(model, cfg=cfg.float8)
    assert summary.grouped_expert_weights == 0 and summary.experts_left_bf16 > 0
    text = startup_summary(cfg=cfg, args=args, model=model, world=1, dp_size=1, device=torch.device("cpu"),
                           resume="fresh start")
    assert "BF16 experts (float8.moe_experts, but no expert weight has dims divisible by 16)" in text, text


def test_print_config_shows_a_config_for_another_machine_then_names_what_fails_here(capsys):
    """The full model's TOML names cluster data paths: --print-config still prints the merged config, then the
    check fails naming the key (it printed nothing before)."""
    with pytest.raises(ConfigError) as info:
        load_config(["--config", "train_configs/glm5_3_flash.toml", "--print-config"])
    assert info.value.key == "data.paths" and info.value.host
    out = capsys.readouterr().out
    assert "[model]" in out and 'flavor = "glm5_3_flash"' in out, out[:500]


def test_print_config_prints_nothing_for_an_invalid_config(capsys):
    """`--print-config > cfg.toml` must not leave a file that looks valid: a fault of the config itself (here an
    unknown role, or an unknown flavor) prints nothing; only a file this host lacks still lets the config show."""
    for argv, key in ((["--float8.keep_bf16", "foo"], "float8.keep_bf16"),
                      (["--model.flavor", "nosuch"], "model.flavor")):
        with pytest.raises(ConfigError) as info:
            load_config(["--config", "train_configs/debug_model.toml", "--print-config", *argv])
        assert info.value.key == key and not info.value.host
        assert capsys.readouterr().out == ""


@pytest.mark.parametrize("argv, key", [
    (["--compile.enable", "true", "--compile.components", "[]"], "compile.components"),
    (["--compile.enable", "true", "--compile.backend", "aot_eager", "--compile.mode", "max-autotune"], "compile.mode"),
])
def test_compile_settings_that_would_be_ignored_name_the_key(argv, key):
    """An empty components list compiled the whole model anyway; a mode with a backend other than inductor was
    dropped without a word."""
    with pytest.raises(ConfigError) as info:
        load_config(["--config", "train_configs/debug_model.toml", *argv])
    assert info.value.key == key, info.value


def test_fp8_all_gather_without_fp8_is_a_warning_not_silence():
    """fsdp_float8_all_gather = true while float8.enable is false does nothing: the trainer warns (train.py logs
    idle_keys at start-up); with FP8 on, or the key off, there is nothing to say."""
    idle = load_config(["--float8.fsdp_float8_all_gather", "true"]).float8.idle_keys()
    assert "float8.fsdp_float8_all_gather" in idle and "float8.enable is false" in idle
    assert load_config(["--float8.enable", "true", "--float8.fsdp_float8_all_gather", "true"]).float8.idle_keys() == ""
    assert load_config([]).float8.idle_keys() == ""
