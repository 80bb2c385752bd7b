"""HF checkpoint I/O against transformers glm5_next files: exact loads, bit-identical HF round trips, FP8, shards,
strict mismatch errors and atomic, non-clobbering saves."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from torchtitan_glm.models.glm5 import Glm5Model, Glm5ModelArgs  # noqa: E402
from torchtitan_glm.models.glm5 import hf_io  # noqa: E402
from torchtitan_glm.models.glm5.hf_io import from_pretrained, save_pretrained  # noqa: E402
from torchtitan_glm.models.glm5.state_dict_adapter import CheckpointMismatchError  # noqa: E402

from .hf_reference import hf_to_ours  # noqa: E402

P = "model.language_model."
TEXT = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=16,
    q_lora_rank=24, qk_nope_head_dim=16, v_head_dim=16, index_topk=8, index_head_dim=16, index_n_heads=4,
    linear_head_dim=16, linear_num_heads=4, hc_mult=2, index_kpool=4,
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"], pad_token_id=None,
)
VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64,
              projection_intermediate_size=32)


@torch.no_grad()
def randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Small distinct random values in every parameter and floating buffer (router bias included)."""
    torch.manual_seed(seed)
    for p in module.parameters():
        p.copy_(torch.randn_like(p) * 0.05)
    for b in module.buffers():
        if b.is_floating_point():
            b.copy_(torch.randn_like(b) * 0.05)
    return module


def read_files(hf_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(hf_dir.glob("*.safetensors"))
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                assert k not in out, k
                out[k] = h.get_tensor(k)
    return out


def write_variant(src: Path, dst: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    dst.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text()) if config is None else config
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return dst


def assert_same_files(a: Path, b: Path) -> None:
    ta, tb = read_files(a), read_files(b)
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype, k
        assert torch.equal(ta[k], tb[k]), k


@pytest.fixture(scope="module")
def hf_model():
    cfg = transformers.Glm5NextConfig(text_config=dict(TEXT), vision_config=dict(VISION))
    model = transformers.Glm5NextForConditionalGeneration(cfg).eval()
    return randomize(model, seed=0)


@pytest.fixture(scope="module")
def hf_dir(hf_model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "ckpt"
    hf_model.save_pretrained(path)
    return path


def test_load_matches_transformers_tensors(hf_model, hf_dir, caplog):
    with caplog.at_level(logging.WARNING):
        ours = from_pretrained(hf_dir)
    assert any("MTP" in r.message for r in caplog.records)
    assert ours.hf_origin.missing_mtp
    lm = hf_model.model.language_model
    expected = hf_to_ours(lm.state_dict())  # the lead's independent in-memory HF -> ours mapping
    expected["lm_head.weight"] = hf_model.lm_head.weight
    got = ours.state_dict()
    assert sorted(expected) == sorted(k for k in got if not k.startswith("mtp."))
    for k, v in expected.items():
        assert got[k].dtype == torch.float32, k
        assert torch.equal(got[k], v.float()), k
    # The absent MTP got the model's own init (norms are ones), not garbage.
    assert torch.equal(got["mtp.shared_head.norm.weight"], torch.ones(TEXT["hidden_size"]))
    assert torch.isfinite(got["mtp.mlp.experts.gate_proj"]).all()


def test_strict_mtp_flag_refuses_checkpoint_without_mtp(hf_dir):
    with pytest.raises(CheckpointMismatchError, match=r"layers\.4\.eh_proj\.weight"):
        from_pretrained(hf_dir, allow_missing_mtp=False)


def test_hf_round_trip_is_bit_identical(hf_dir, tmp_path, hf_model):
    out = save_pretrained(from_pretrained(hf_dir), tmp_path / "out")
    assert_same_files(hf_dir, out)  # vision tensors kept, no MTP invented, dtypes and values untouched
    assert json.loads((out / "config.json").read_text()) == json.loads((hf_dir / "config.json").read_text())
    # transformers reads our output back into the same weights.
    again = transformers.Glm5NextForConditionalGeneration.from_pretrained(out).eval()
    ref = hf_model.state_dict()
    for k, v in again.state_dict().items():
        assert torch.equal(v, ref[k]), k


def test_mixed_dtype_hf_round_trip(hf_dir, tmp_path):
    # What transformers writes for a BF16 model: BF16 everywhere except its keep-in-FP32 list (A_log, dt_bias, conv1d,
    # hc base/scale, router weight and bias). hc fn and the KPool APE are BF16 in the file but FP32 in our model.
    mixed_dir = tmp_path / "mixed"
    transformers.Glm5NextForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.bfloat16).save_pretrained(
        mixed_dir)
    files = read_files(mixed_dir)
    assert files[f"{P}layers.0.hc_attn_fn"].dtype == torch.bfloat16
    assert files[f"{P}layers.0.self_attn.A_log"].dtype == torch.float32
    model = from_pretrained(mixed_dir, dtype=torch.bfloat16)
    sd = model.state_dict()
    assert sd["layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    for k in ("layers.0.attn_hc.fn", "layers.0.self_attn.decay.A_log", "layers.0.self_attn.q_conv1d.weight",
              "layers.1.mlp.gate.weight", "layers.1.mlp.gate.e_score_correction_bias",
              "layers.3.self_attn.indexer.kpool_ape.weight"):
        assert sd[k].dtype == torch.float32, k  # keep_fp32 modules stay FP32 under a BF16 load
    assert torch.equal(sd["layers.0.attn_hc.fn"], files[f"{P}layers.0.hc_attn_fn"].float())
    out = save_pretrained(model, tmp_path / "out")
    assert_same_files(mixed_dir, out)  # each tensor goes back to its file dtype


def _tiny_ours(seed: int) -> Glm5Model:
    args = Glm5ModelArgs.from_hf_config(dict(TEXT), num_nextn_predict_layers=1)
    return randomize(Glm5Model(args), seed=seed)


def test_our_model_round_trip(tmp_path):
    model = _tiny_ours(seed=1)
    out = save_pretrained(model, tmp_path / "fp32")
    assert any(k.startswith(f"{P}layers.4.") for k in read_files(out))  # MTP exported as layer N
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Glm5NextForConditionalGeneration"] and cfg["model_type"] == "glm5_next"
    hf_cfg = transformers.Glm5NextConfig.from_pretrained(out)  # transformers parses our config
    assert hf_cfg.text_config.hc_mult == TEXT["hc_mult"] and hf_cfg.text_config.index_kpool == TEXT["index_kpool"]
    loaded = from_pretrained(out, allow_missing_mtp=False)
    ref = model.state_dict()
    got = loaded.state_dict()
    assert sorted(got) == sorted(ref)
    for k, v in ref.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k

    out16 = save_pretrained(model, tmp_path / "bf16", dtype=torch.bfloat16)
    files = read_files(out16)
    assert files[f"{P}layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert files[f"{P}layers.0.hc_attn_fn"].dtype == torch.float32
    got16 = from_pretrained(out16, dtype=torch.bfloat16).state_dict()
    for k, v in ref.items():
        want = v if got16[k].dtype == torch.float32 else v.bfloat16()
        assert torch.equal(got16[k], want), k


def test_learned_hc_head_is_recorded_and_loads_back(tmp_path):
    # hc_head = "learned" adds parameters: config.json must say so, or the checkpoint cannot be read back.
    torch.manual_seed(2)
    model = Glm5Model(_tiny_ours(seed=2).args.replace(hc_head="learned"))
    out = save_pretrained(model, tmp_path / "learned")
    assert json.loads((out / "config.json").read_text())["text_config"]["hc_head"] == "learned"
    loaded = from_pretrained(out)
    assert loaded.args.hc_head == "learned"
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    again = save_pretrained(loaded, tmp_path / "again")  # a loaded checkpoint keeps the key when re-exported
    assert json.loads((again / "config.json").read_text())["text_config"]["hc_head"] == "learned"
    mean = save_pretrained(_tiny_ours(seed=1), tmp_path / "mean")  # the released default: no key
    assert "hc_head" not in json.loads((mean / "config.json").read_text())["text_config"]


def _quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    bo, bi = block
    scale = torch.empty(math.ceil(rows / bo), math.ceil(cols / bi))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi].float()
            s = tile.abs().amax().clamp_min(1e-12) / 448.0
            q[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi] = (tile / s).to(torch.float8_e4m3fn)
            scale[i, j] = s
    return q, scale


@pytest.mark.parametrize("block", [None, (48, 48)])
def test_fp8_checkpoint_loads_within_rounding(hf_dir, tmp_path, block):
    src = read_files(hf_dir)
    not_convert = ["lm_head", f"{P}embed_tokens", "mlp.gate", r"model\.language_model\.layers\.\d+\.self_attn\.indexer"]
    quant_cfg = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                 "modules_to_not_convert": not_convert}
    if block is not None:
        quant_cfg["weight_block_size"] = list(block)
    blk = block or (128, 128)
    from torchtitan_glm.models.glm5.state_dict_adapter import matches_module_pattern

    tensors, quantized, bf16 = {}, {}, []
    for k, v in src.items():
        linear = k.endswith("_proj.weight") and not k.startswith("model.visual.")
        if linear and not matches_module_pattern(k, not_convert):
            tensors[k], tensors[k + "_scale_inv"] = _quantize(v, blk)
            quantized[k] = v
        elif v.ndim == 2 and "hc_" not in k:
            tensors[k] = v.bfloat16()  # modules_to_not_convert and other matrices stored BF16, no scale
            bf16.append(k)
        else:
            tensors[k] = v
    assert len(quantized) > 50 and f"{P}layers.3.self_attn.indexer.weights_proj.weight" in bf16
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["quantization_config"] = quant_cfg
    fp8_dir = write_variant(hf_dir, tmp_path / "fp8", tensors, cfg)

    model = from_pretrained(fp8_dir, dtype=torch.float32)
    got = hf_io.Glm5StateDictAdapter(model.args).to_hf(
        {k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")}, allow_missing_mtp=True)
    for k, w in quantized.items():
        q, s = tensors[k].float(), tensors[k + "_scale_inv"]
        full = s.repeat_interleave(blk[0], 0)[: w.shape[0]].repeat_interleave(blk[1], 1)[:, : w.shape[1]]
        assert torch.equal(got[k], q * full), k
        assert ((got[k] - w).abs() <= w.abs() * 2**-4 + full * (2**-10 + 1e-6)).all(), k
    for k in bf16:
        if not k.startswith("model.visual."):
            assert torch.equal(got[k], src[k].bfloat16().float()), k

    out = save_pretrained(model, tmp_path / "deq")
    saved_cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in saved_cfg
    files = read_files(out)
    assert not any(k.endswith("_scale_inv") for k in files)
    assert all(files[k].dtype == torch.float32 for k in quantized)

    listed = not_convert + [f"{P}layers.2.mlp.experts"]
    wrong = dict(cfg, quantization_config=dict(quant_cfg, modules_to_not_convert=listed))
    bad_dir = write_variant(hf_dir, tmp_path / "fp8_bad", tensors, wrong)
    msg = r"layers\.2\.mlp\.experts\.\d+\.\w+_proj\.weight belongs to a module listed"
    with pytest.raises(CheckpointMismatchError, match=msg):
        from_pretrained(bad_dir)
    orphan = {k: v for k, v in tensors.items() if k != f"{P}layers.0.self_attn.q_proj.weight_scale_inv"}
    orphan_dir = write_variant(hf_dir, tmp_path / "fp8_orphan", orphan, cfg)
    with pytest.raises(CheckpointMismatchError, match=r"layers\.0\.self_attn\.q_proj\.weight has no"):
        from_pretrained(orphan_dir)


def test_sharded_checkpoint_loads(hf_dir, tmp_path):
    model = from_pretrained(hf_dir)
    out = save_pretrained(model, tmp_path / "sharded", max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and not (out / "model.safetensors").exists()
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in read_files(out).values())
    assert_same_files(hf_dir, out)
    loaded = from_pretrained(out)
    ref = model.state_dict()
    for k, v in loaded.state_dict().items():
        if not k.startswith("mtp."):
            assert torch.equal(v, ref[k]), k
    # transformers reads our sharded layout too.
    again = transformers.Glm5NextForConditionalGeneration.from_pretrained(out)
    assert torch.equal(again.lm_head.weight, ref["lm_head.weight"])

    # An index naming a tensor its shard lacks is an error naming it.
    index["weight_map"][f"{P}layers.0.hc_attn_ghost"] = shards[0]
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointMismatchError, match="hc_attn_ghost"):
        from_pretrained(out)


@pytest.mark.parametrize("kind", ["missing", "unexpected", "shape"])
def test_mismatched_checkpoint_names_the_tensor(hf_dir, tmp_path, kind):
    tensors = read_files(hf_dir)
    name = f"{P}layers.2.self_attn.dt_bias"
    if kind == "missing":
        del tensors[name]
    elif kind == "unexpected":
        name = f"{P}layers.1.mlp.experts.8.up_proj.weight"  # one expert too many
        tensors[name] = torch.zeros(32, 64)
    else:
        tensors[name] = torch.zeros(65)
    bad = write_variant(hf_dir, tmp_path / kind, tensors)
    with pytest.raises(CheckpointMismatchError, match=name.replace(".", r"\.")) as err:
        from_pretrained(bad)
    if kind != "missing":
        assert "model.safetensors" in str(err.value)  # names the file too


def test_save_refuses_to_clobber_and_is_atomic(hf_dir, tmp_path, monkeypatch):
    model = from_pretrained(hf_dir)
    out = tmp_path / "existing"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="overwrite"):
        save_pretrained(model, out)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"] and (out / "keep.txt").read_text() == "precious"

    # A failure half-way (second shard) leaves the old directory intact and no temporary directory behind.
    import safetensors.torch as st

    calls = []

    def failing_save(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        return st.save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(st, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(model, out, overwrite=True, max_shard_bytes=40_000)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"]
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]

    save_pretrained(model, out, overwrite=True)
    assert not (out / "keep.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"]
    assert_same_files(hf_dir, out)
    shutil.rmtree(out)
