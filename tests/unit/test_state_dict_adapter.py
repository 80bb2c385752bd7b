"""Glm5StateDictAdapter on fake state dicts: exact round trips, layout, strict errors, MTP handling, FP8 dequant."""

from __future__ import annotations

import math

import pytest
import torch

from torchtitan_glm.models.glm5.args import DSA, KDA, Glm5ModelArgs
from torchtitan_glm.models.glm5.state_dict_adapter import (
    CheckpointMismatchError,
    Glm5StateDictAdapter,
    dequantize_fp8_blockwise,
    expected_hf_shapes,
    matches_module_pattern,
)

P = "model.language_model."


def tiny_args(**overrides) -> Glm5ModelArgs:
    cfg = dict(
        vocab_size=40, hidden_size=24, intermediate_size=20, moe_intermediate_size=12, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=3, num_experts_per_tok=2, kv_lora_rank=8,
        q_lora_rank=12, qk_nope_head_dim=6, v_head_dim=5, index_topk=8, index_head_dim=4, index_n_heads=2,
        index_kpool=4, linear_num_heads=2, linear_head_dim=4, linear_conv_kernel_dim=3, hc_mult=2, pad_token_id=None,
        layer_types=[KDA, DSA, DSA, KDA], indexer_types=["full", "full", "shared", "full"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], num_nextn_predict_layers=1,
    )
    cfg.update(overrides)
    return Glm5ModelArgs(**cfg)


def fake_hf(args: Glm5ModelArgs, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors for every expected HF name; 2-D weights in BF16 so dtypes are exercised too."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_hf_shapes(args).items():
        t = torch.randn(shape, generator=gen)
        out[name] = t.bfloat16() if len(shape) == 2 and "hc_" not in name else t
    return out


def test_round_trip_is_bit_identical():
    args = tiny_args()
    adapter = Glm5StateDictAdapter(args)
    hf = fake_hf(args)
    ours = adapter.from_hf(hf)
    back = adapter.to_hf(ours)
    assert sorted(back) == sorted(hf)
    for name, t in hf.items():
        assert back[name].dtype == t.dtype, name
        assert torch.equal(back[name], t), name
    again = adapter.from_hf(back)
    assert sorted(again) == sorted(ours)
    assert all(torch.equal(again[k], ours[k]) and again[k].dtype == ours[k].dtype for k in ours)


def test_internal_layout_renames_stacks_and_mtp():
    args = tiny_args()
    hf = fake_hf(args, seed=1)
    ours = Glm5StateDictAdapter(args).from_hf(hf)
    n = args.num_hidden_layers
    pairs = {
        "layers.0.attn_hc.fn": f"{P}layers.0.hc_attn_fn",
        "layers.3.ffn_hc.scale": f"{P}layers.3.hc_ffn_scale",
        "layers.0.self_attn.decay.A_log": f"{P}layers.0.self_attn.A_log",
        "layers.0.self_attn.decay.dt_bias": f"{P}layers.0.self_attn.dt_bias",
        "layers.0.self_attn.q_conv1d.weight": f"{P}layers.0.self_attn.q_conv1d.weight",
        "layers.1.self_attn.indexer.kpool_ape.weight": f"{P}layers.1.self_attn.indexer.index_kpool_compress_ape",
        "layers.1.self_attn.indexer.index_kpool_compress_gate":
            f"{P}layers.1.self_attn.indexer.index_kpool_compress_gate",
        "mtp.shared_head.norm.weight": f"{P}layers.{n}.shared_head.norm.weight",
        "mtp.eh_proj.weight": f"{P}layers.{n}.eh_proj.weight",
        "mtp.self_attn.indexer.kpool_ape.weight": f"{P}layers.{n}.self_attn.indexer.index_kpool_compress_ape",
        "embed_tokens.weight": f"{P}embed_tokens.weight",
        "lm_head.weight": "lm_head.weight",
        "norm.weight": f"{P}norm.weight",
    }
    for our_name, hf_name in pairs.items():
        assert torch.equal(ours[our_name], hf[hf_name]), our_name
    e, i, d = args.n_routed_experts, args.moe_intermediate_size, args.hidden_size
    for prefix, layer in (("layers.2.", 2), ("mtp.", n)):
        gate, down = ours[f"{prefix}mlp.experts.gate_proj"], ours[f"{prefix}mlp.experts.down_proj"]
        assert gate.shape == (e, i, d) and down.shape == (e, d, i)
        for x in range(e):
            assert torch.equal(gate[x], hf[f"{P}layers.{layer}.mlp.experts.{x}.gate_proj.weight"])
            assert torch.equal(down[x], hf[f"{P}layers.{layer}.mlp.experts.{x}.down_proj.weight"])
    # No hc on the MTP layer, no indexer on the 'shared' DSA layer, and no HF-only names leak into ours.
    assert not any(k.startswith("mtp.") and "_hc" in k for k in ours)
    assert not any(k.startswith("layers.2.self_attn.indexer") for k in ours)
    assert not any("hc_attn" in k or "index_kpool_compress_ape" in k or ".experts.0." in k for k in ours)


def test_internal_names_match_the_model():
    from torchtitan_glm.models.glm5 import Glm5Model

    args = tiny_args()
    with torch.device("meta"):
        model = Glm5Model(args)
    ours = Glm5StateDictAdapter(args).from_hf(fake_hf(args))
    model_sd = model.state_dict()
    assert sorted(ours) == sorted(model_sd)
    for k, v in model_sd.items():
        assert ours[k].shape == v.shape, k


def test_released_config_shapes():
    args = Glm5ModelArgs()  # GLM-5.3-Flash defaults
    shapes = expected_hf_shapes(args)
    assert shapes[f"{P}layers.0.self_attn.q_conv1d.weight"] == (8192, 1, 4)
    assert shapes[f"{P}layers.0.self_attn.A_log"] == (64,)
    assert shapes[f"{P}layers.3.self_attn.indexer.index_kpool_compress_ape"] == (4, 128)
    assert shapes[f"{P}layers.3.self_attn.indexer.index_kpool_compress_gate"] == (128, 4096)
    assert shapes[f"{P}layers.3.self_attn.kv_b_proj.weight"] == (64 * 512, 512)
    assert shapes[f"{P}layers.0.hc_attn_fn"] == (24, 16384)
    assert shapes[f"{P}layers.45.eh_proj.weight"] == (4096, 8192)
    assert shapes[f"{P}layers.44.mlp.experts.287.down_proj.weight"] == (4096, 2048)
    assert f"{P}layers.45.hc_attn_fn" not in shapes
    assert f"{P}layers.2.mlp.gate.weight" not in shapes  # first 3 layers are dense
    assert sum(".experts." in k for k in shapes) == (42 + 1) * 288 * 3


@pytest.mark.parametrize("kind", ["missing", "unexpected", "shape"])
def test_errors_name_the_tensor(kind):
    args = tiny_args()
    adapter = Glm5StateDictAdapter(args)
    hf = fake_hf(args)
    name = f"{P}layers.1.self_attn.indexer.wk.weight"
    if kind == "missing":
        del hf[name]
    elif kind == "unexpected":
        name = f"{P}layers.0.self_attn.bogus.weight"
        hf[name] = torch.zeros(3)
    else:
        hf[name] = torch.zeros(5, 5)
    with pytest.raises(CheckpointMismatchError, match=name.replace(".", r"\.")) as err:
        adapter.from_hf(hf)
    assert isinstance(err.value, ValueError)
    assert name in {"missing": err.value.missing, "unexpected": err.value.unexpected,
                    "shape": list(err.value.mismatched)}[kind]


def test_to_hf_rejects_foreign_and_misshaped_state():
    args = tiny_args()
    adapter = Glm5StateDictAdapter(args)
    ours = adapter.from_hf(fake_hf(args))
    bad = dict(ours, **{"layers.0.bogus.weight": torch.zeros(2)})
    with pytest.raises(CheckpointMismatchError, match=r"layers\.0\.bogus"):
        adapter.to_hf(bad)
    bad = dict(ours, **{"layers.1.mlp.experts.up_proj": torch.zeros(2, 12, 24)})
    with pytest.raises(CheckpointMismatchError, match=r"layers\.1\.mlp\.experts\.up_proj"):
        adapter.to_hf(bad)


def test_ignored_tensors_are_skipped_and_reported():
    args = tiny_args()
    adapter = Glm5StateDictAdapter(args)
    hf = fake_hf(args)
    n = args.num_hidden_layers
    extra = {"model.visual.blocks.0.attn.qkv.weight": torch.zeros(6, 2),
             f"{P}layers.{n}.embed_tokens.weight": hf[f"{P}embed_tokens.weight"].clone(),
             f"{P}layers.{n}.shared_head.head.weight": hf["lm_head.weight"].clone()}
    ours, report = adapter.from_hf_with_report({**hf, **extra})
    assert sorted(report.ignored) == sorted(extra)
    assert torch.equal(ours["lm_head.weight"], hf["lm_head.weight"])
    assert not any("embed_tokens" in k and k.startswith("mtp.") for k in ours)


def test_missing_mtp_only_when_allowed():
    args = tiny_args()
    adapter = Glm5StateDictAdapter(args)
    mtp = f"{P}layers.{args.num_hidden_layers}."
    hf = {k: v for k, v in fake_hf(args).items() if not k.startswith(mtp)}
    with pytest.raises(CheckpointMismatchError, match=rf"{mtp.replace('.', '[.]')}eh_proj"):
        adapter.from_hf(hf)
    ours, report = adapter.from_hf_with_report(hf, allow_missing_mtp=True)
    assert not any(k.startswith("mtp.") for k in ours)
    assert f"{mtp}eh_proj.weight" in report.missing_mtp and len(report.missing_mtp) > 20
    # The exemption covers the whole MTP layer only: a partial MTP or any other missing tensor still fails.
    partial = {k: v for k, v in fake_hf(args).items() if k != f"{mtp}enorm.weight"}
    with pytest.raises(CheckpointMismatchError, match=rf"{mtp.replace('.', '[.]')}enorm"):
        adapter.from_hf(partial, allow_missing_mtp=True)
    trunk_missing = {k: v for k, v in hf.items() if k != f"{P}norm.weight"}
    with pytest.raises(CheckpointMismatchError, match=r"language_model\.norm\.weight"):
        adapter.from_hf(trunk_missing, allow_missing_mtp=True)
    # Export without the MTP mirrors it.
    back = adapter.to_hf(ours, allow_missing_mtp=True)
    assert sorted(back) == sorted(hf)
    with pytest.raises(CheckpointMismatchError):
        adapter.to_hf(ours)


def test_mtp_layer_is_unexpected_without_mtp():
    args = tiny_args()
    hf = fake_hf(args)
    adapter = Glm5StateDictAdapter(tiny_args(num_nextn_predict_layers=0))
    with pytest.raises(CheckpointMismatchError, match="num_nextn_predict_layers"):
        adapter.from_hf(hf)


# -------------------------------------------------------------------------------------------------------- FP8
def quantize_blockwise(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference e4m3 block quantiser (tile by tile, scale = amax / 448), written independently of the loader."""
    rows, cols = w.shape
    nr, nc = math.ceil(rows / block), math.ceil(cols / block)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.empty(nr, nc, dtype=torch.float32)
    for i in range(nr):
        for j in range(nc):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block].float()
            s = tile.abs().amax().clamp_min(1e-12) / 448.0
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / s).to(torch.float8_e4m3fn)
            scale[i, j] = s
    return q, scale


def reference_dequant(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    rows, cols = q.shape
    full = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return q.float() * full


@pytest.mark.parametrize("shape,block", [((300, 200), 128), ((256, 128), 128), ((37, 50), 16), ((5, 7), 128)])
def test_fp8_dequant_within_e4m3_rounding(shape, block):
    gen = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=gen) * torch.logspace(-3, 1, shape[1])  # varied magnitudes per column
    q, scale = quantize_blockwise(w, block)
    got = dequantize_fp8_blockwise(q, scale, block)
    assert got.dtype == torch.float32 and got.shape == w.shape
    assert torch.equal(got, reference_dequant(q, scale, block))
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 (normals); subnormal spacing 2^-9 -> abs error <= 2^-10 * s.
    s_full = scale.repeat_interleave(block, 0)[: shape[0]].repeat_interleave(block, 1)[:, : shape[1]]
    bound = w.abs() * 2**-4 + s_full * (2**-10 + 1e-6)
    assert ((got - w).abs() <= bound).all()
    assert (got - w).abs().max() > 0  # it really was quantised
    assert dequantize_fp8_blockwise(q, scale, block, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_fp8_dequant_rejects_wrong_scale_shape():
    q, scale = quantize_blockwise(torch.randn(200, 100), 128)
    with pytest.raises(ValueError, match=r"\[2, 1\]|\(2, 1\)"):
        dequantize_fp8_blockwise(q, scale[:1], 128)


def test_from_hf_dequantizes_fp8_pairs_and_validates_them():
    args = tiny_args()
    adapter = Glm5StateDictAdapter(args)
    hf = {k: v.float() for k, v in fake_hf(args, seed=3).items()}
    block = 8
    names = [f"{P}layers.0.self_attn.q_proj.weight", f"{P}layers.1.mlp.experts.2.down_proj.weight", "lm_head.weight"]
    quant = dict(hf)
    for name in names:
        quant[name], quant[name + "_scale_inv"] = quantize_blockwise(hf[name], block)
    ours, report = adapter.from_hf_with_report(quant, block=block)
    assert report.dequantized == sorted(names)
    q, s = quant[names[1]], quant[names[1] + "_scale_inv"]
    assert torch.equal(ours["layers.1.mlp.experts.down_proj"][2], reference_dequant(q, s, block))
    q, s = quant[names[0]], quant[names[0] + "_scale_inv"]
    assert torch.equal(ours["layers.0.self_attn.q_proj.weight"], reference_dequant(q, s, block))
    assert torch.equal(ours["layers.0.self_attn.k_proj.weight"], hf[f"{P}layers.0.self_attn.k_proj.weight"])

    no_scale = {k: v for k, v in quant.items() if k != names[0] + "_scale_inv"}
    with pytest.raises(CheckpointMismatchError, match=names[0].replace(".", r"\.") + " has no"):
        adapter.from_hf(no_scale, block=block)
    orphan = dict(hf, **{f"{P}norm.weight_scale_inv": torch.ones(1, 1)})
    with pytest.raises(CheckpointMismatchError, match=r"norm\.weight_scale_inv"):
        adapter.from_hf(orphan, block=block)
    with pytest.raises(CheckpointMismatchError, match=r"lm_head\.weight belongs to a module listed"):
        adapter.from_hf(quant, block=block, modules_to_not_convert=["lm_head"])
    with pytest.raises(CheckpointMismatchError, match=r"q_proj\.weight_scale_inv has shape"):
        adapter.from_hf(quant, block=4)


def test_modules_to_not_convert_patterns():
    assert matches_module_pattern("lm_head.weight", ["lm_head"])
    assert matches_module_pattern(f"{P}layers.1.mlp.gate.weight", ["mlp.gate"])
    assert not matches_module_pattern(f"{P}layers.1.mlp.gate_proj.weight", ["mlp.gate"])
    assert matches_module_pattern(f"{P}layers.1.self_attn.q_a_proj.weight", [f"{P}layers.1"])
    assert not matches_module_pattern(f"{P}layers.11.self_attn.q_a_proj.weight", [f"{P}layers.1"])
    pattern = r"model.language_model.layers.\d+.self_attn.indexer"
    assert matches_module_pattern(f"{P}layers.11.self_attn.indexer.wk.weight", [pattern])
