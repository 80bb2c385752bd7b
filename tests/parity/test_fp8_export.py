"""save_pretrained(fp8=True) writes the released FP8 layout (E4M3 + 128x128 block weight_scale_inv for what the split
converts, BF16 for the rest, modules_to_not_convert naming the BF16 modules) and from_pretrained reads it back:
dequantised weights within E4M3 block rounding of the originals, everything else bit-exact."""

import json

import pytest
import torch
from safetensors import safe_open

from torchtitan_glm.models.glm5 import Glm5Model, from_pretrained, get_flavor, save_pretrained
from torchtitan_glm.models.glm5.state_dict_adapter import Glm5StateDictAdapter


def _files(path):
    out = {}
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for k in f.keys():
            out[k] = f.get_tensor(k)
    return out


def test_fp8_export_round_trip(tmp_path):
    # Wider than the debug flavor so matrices span several 128x128 blocks, with partial edge blocks (384, 160).
    args = get_flavor("debug").replace(hidden_size=256, intermediate_size=384, moe_intermediate_size=160,
                                       kv_lora_rank=32, q_lora_rank=64)
    torch.manual_seed(0)
    model = Glm5Model(args)
    with torch.no_grad():  # a few large outliers, so per-block scales matter
        for p in model.parameters():
            if p.ndim >= 2:
                p.view(-1)[:: 997].mul_(50.0)
    save_pretrained(model, tmp_path / "fp8", dtype=torch.bfloat16, fp8=True)
    files = _files(tmp_path / "fp8")
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    quant = cfg["quantization_config"]
    assert quant["quant_method"] == "fp8" and quant["weight_block_size"] == [128, 128]
    not_convert = set(quant["modules_to_not_convert"])
    p = "model.language_model.layers"
    # The serving-BF16 modules are listed and stored BF16; the FP8 ones are E4M3 with scales.
    for mod in (f"{p}.0.self_attn.q_proj", f"{p}.0.self_attn.o_proj", f"{p}.3.self_attn.kv_b_proj",
                f"{p}.3.self_attn.o_proj", f"{p}.3.self_attn.indexer", f"{p}.4.self_attn.indexer", "lm_head",
                f"{p}.1.mlp.gate"):
        assert mod in not_convert, mod
    assert files[f"{p}.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert files[f"{p}.3.self_attn.indexer.index_kpool_compress_gate"].dtype == torch.bfloat16
    fp8_names = [n for n, t in files.items() if t.dtype == torch.float8_e4m3fn]
    assert f"{p}.1.mlp.experts.3.down_proj.weight" in fp8_names and f"{p}.0.mlp.up_proj.weight" in fp8_names
    assert f"{p}.2.mlp.shared_experts.gate_proj.weight" in fp8_names and f"{p}.4.eh_proj.weight" in fp8_names
    for n in fp8_names:
        scale = files[n + "_scale_inv"]
        rows, cols = files[n].shape
        assert scale.dtype == torch.float32 and scale.shape == ((rows + 127) // 128, (cols + 127) // 128)
        assert not any(n.startswith(m + ".") for m in not_convert), n

    loaded = from_pretrained(tmp_path / "fp8", dtype=torch.float32)
    adapter = Glm5StateDictAdapter(args)
    ours, back = model.state_dict(), loaded.state_dict()
    fp8_ours = set()
    for name in ours:
        hf = adapter.internal_to_hf(name)
        if any(h in fp8_names for h in (hf if isinstance(hf, list) else [hf])):
            fp8_ours.add(name)
    assert fp8_ours and len(fp8_ours) < len(ours)
    for name, w in ours.items():
        got = back[name]
        if name in fp8_ours:
            # E4M3 keeps 3 mantissa bits: |err| <= |w| 2^-4 for normal values, <= 2^-10 * scale below 2^-6 * scale
            # (scale = tile amax / 448), so bound by the tile's amax.
            amax = w.abs().amax()
            bound = w.abs() * 2.0**-4 + amax / 448 * 2.0**-9 + 1e-12
            assert ((got - w).abs() <= bound).all(), name
            assert not torch.equal(got, w), name  # it really went through FP8
        elif w.dtype == torch.float32 and name in _fp32_kept(model):
            assert torch.equal(got, w), name
        else:
            assert torch.equal(got, w.to(torch.bfloat16).float()), name


def _fp32_kept(model):
    return {f"{p}.{n}" if p else n for p, m in model.named_modules() if getattr(type(m), "keep_fp32", False)
            for n, _ in m.named_parameters(recurse=False)} | {
        f"{p}.{n}" for p, m in model.named_modules() if getattr(type(m), "keep_fp32", False)
        for n, _ in m.named_buffers(recurse=False)}


def test_fp8_export_with_indexer_converted_loads_back(tmp_path):
    # float8.keep_bf16 without "indexer": the indexer's Linears go E4M3, so the indexer cannot be listed whole in
    # modules_to_not_convert (the loader refuses an FP8 tensor inside a listed module).
    args = get_flavor("debug").replace(hidden_size=256, kv_lora_rank=32, q_lora_rank=64)
    torch.manual_seed(0)
    model = Glm5Model(args)
    save_pretrained(model, tmp_path / "fp8", dtype=torch.bfloat16, fp8=True, keep_bf16=("mla", "kda"))
    files = _files(tmp_path / "fp8")
    not_convert = set(json.loads((tmp_path / "fp8" / "config.json").read_text())
                      ["quantization_config"]["modules_to_not_convert"])
    indexer = "model.language_model.layers.3.self_attn.indexer"
    assert files[f"{indexer}.wk.weight"].dtype == torch.float8_e4m3fn
    assert indexer not in not_convert
    assert files["model.language_model.layers.3.self_attn.o_proj.weight"].dtype == torch.bfloat16
    loaded = from_pretrained(tmp_path / "fp8", dtype=torch.float32)
    name = next(n for n in model.state_dict() if n.endswith("indexer.wk.weight"))
    w, got = model.state_dict()[name], loaded.state_dict()[name]
    assert not torch.equal(got, w) and ((got - w).abs() <= w.abs() * 2.0**-4 + w.abs().amax() / 448 * 2.0**-9).all()


def test_fp8_export_refuses_unknown_keep_bf16_roles_and_keep_bf16_without_fp8(tmp_path):
    # A typo ("indexr") would export the indexer in FP8 and drop it from modules_to_not_convert without a word.
    from torchtitan_glm.config import FLOAT8_ROLES

    model = Glm5Model(get_flavor("debug"))
    for keep, bad in ((["indexr", "mla", "kda"], "'indexr'"), (["bogus"], "'bogus'"), ("indexer", "'indexer'")):
        with pytest.raises(ValueError, match="keep_bf16") as err:
            save_pretrained(model, tmp_path / "fp8", fp8=True, keep_bf16=keep)
        assert bad in str(err.value) and (isinstance(keep, str) or str(list(FLOAT8_ROLES)) in str(err.value))
    with pytest.raises(ValueError, match="keep_bf16.*fp8=True"):
        save_pretrained(model, tmp_path / "bf16", keep_bf16=["mla"])
    assert not (tmp_path / "fp8").exists() and not (tmp_path / "bf16").exists()
    from torchtitan_glm.models.glm5.hf_distributed import save_hf_from_sharded

    with pytest.raises(ValueError, match="'indexr'"):  # the sharded export checks the same roles
        save_hf_from_sharded(model, tmp_path / "sharded", fp8=True, keep_bf16=["indexr"])
    assert not (tmp_path / "sharded").exists()
