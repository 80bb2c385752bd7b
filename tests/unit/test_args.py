"""Glm5ModelArgs: HF config parsing (flat and text_config-nested), validation errors, flavors, init conventions."""

from __future__ import annotations

import json

import pytest
import torch

from torchtitan_glm.models.glm5 import Glm5Model, Glm5ModelArgs, ModelArgsError, get_flavor

GLM53_TEXT = {
    "vocab_size": 154880, "hidden_size": 4096, "num_hidden_layers": 45, "num_nextn_predict_layers": 1,
    "index_kpool": 4, "index_topk": 2048, "hc_mult": 4, "n_routed_experts": 288, "first_k_dense_replace": 3,
    "layer_types": ["deepseek_sparse_attention" if i % 4 == 3 else "linear_attention" for i in range(45)],
    "linear_attn_config": {"num_heads": 64, "head_dim": 128, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0},
    "quantization_config": {"quant_method": "fp8"},
}


def test_flat_and_nested_configs_agree(tmp_path):
    flat = Glm5ModelArgs.from_hf_config(GLM53_TEXT)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm5_next", "text_config": GLM53_TEXT,
                                                      "vision_config": {"depth": 24}}))
    nested = Glm5ModelArgs.from_hf_config(tmp_path)
    assert flat == nested
    assert flat.layer_types.count("indexed_attention") == 11 and flat.mlp_layer_types[:4] == ["dense"] * 3 + ["sparse"]
    assert (flat.linear_num_heads, flat.linear_head_dim, flat.linear_conv_kernel_dim, flat.linear_lower_bound) == (
        64, 128, 4, -5.0)
    # the flavor also sets a trainer-side field that config.json never carries (the DSA kernel for short rows)
    assert flat == get_flavor("glm5_3_flash").replace(dsa_dense_max_len=0)
    assert Glm5ModelArgs.from_hf_config(flat.to_hf_config()) == flat


@pytest.mark.parametrize(
    "change,key",
    [
        (dict(index_topk=2050), "index_topk"),
        (dict(qk_rope_head_dim=64), "qk_rope_head_dim"),
        (dict(layer_types=["linear_attention", "mamba"]), "layer_types"),
        (dict(layer_types=["linear_attention"] * 3), "layer_types"),
        (dict(mlp_layer_types=["dense", "moe"]), "mlp_layer_types"),
        (dict(hc_head="weighted"), "hc_head"),
        (dict(scoring_func="softmax"), "scoring_func"),
        (dict(num_experts_per_tok=9, n_routed_experts=8), "num_experts_per_tok"),
    ],
)
def test_invalid_combinations_name_the_key(change, key):
    base = dict(num_hidden_layers=2, n_routed_experts=8, pad_token_id=None)
    base.update(change)
    with pytest.raises(ModelArgsError, match=key):
        Glm5ModelArgs(**base)


def test_unreadable_config_names_the_file(tmp_path):
    with pytest.raises(ModelArgsError, match="config.json"):
        Glm5ModelArgs.from_hf_config(tmp_path)


def test_init_follows_reference_conventions():
    torch.manual_seed(0)
    args = get_flavor("debug").replace(hidden_size=128, intermediate_size=256)
    model = Glm5Model(args)
    kda, dsa = model.layers["0"].self_attn, model.layers["3"].self_attn
    assert torch.all(kda.decay.A_log == 0)  # bounded gate: A_log = 0
    dt = torch.nn.functional.softplus(kda.decay.dt_bias)
    assert dt.min() >= 1e-4 * 0.999 and dt.max() <= 0.1 * 1.001
    assert torch.all(dsa.indexer.index_kpool_compress_gate == 1) and torch.all(dsa.indexer.kpool_ape.weight == 0)
    hc = model.layers["1"].attn_hc
    assert torch.all(hc.base == 0) and torch.all(hc.scale == 1) and abs(hc.fn.std().item() - 0.02) < 0.002
    assert abs(kda.q_proj.weight.std().item() - 0.02) < 0.002
    assert torch.all(model.layers["1"].input_layernorm.weight == 1)
    assert torch.all(model.layers["1"].mlp.gate.e_score_correction_bias == 0)
    assert model.layers["1"].attn_hc.fn.dtype == torch.float32 and kda.decay.dt_bias.dtype == torch.float32


def test_learned_hc_head_option_runs():
    torch.manual_seed(0)
    model = Glm5Model(get_flavor("debug").replace(hc_head="learned"))
    logits = model.logits(torch.randint(0, 512, (1, 9)))
    assert logits.shape == (1, 9, 512) and torch.isfinite(logits).all()
    assert {"hc_head.fn", "hc_head.base", "hc_head.scale"} <= set(dict(model.named_parameters()))
