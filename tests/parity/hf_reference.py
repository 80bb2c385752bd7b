"""Test helpers: tiny transformers glm5_next references with random weights, and HF -> ours weight copies."""

from __future__ import annotations

import torch

transformers = __import__("pytest").importorskip("transformers")
from transformers import Glm5NextTextConfig  # noqa: E402
from transformers.models.glm5_next import modeling_glm5_next as hf_mod  # noqa: E402

from torchtitan_glm.models.glm5 import Glm5ModelArgs  # noqa: E402
from torchtitan_glm.models.glm5.hf_modeling import modeling_to_ours as hf_to_ours  # noqa: E402,F401


def tiny_text_config(**overrides) -> dict:
    # 16 indexer heads: an all-zero ReLU score (an exact tie, whose top-k order the reference leaves to the
    # kernel) is then vanishingly rare, so a selection mismatch means a real bug.
    cfg = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=16,
        q_lora_rank=24, qk_nope_head_dim=16, v_head_dim=16, index_topk=8, index_head_dim=16, index_n_heads=16,
        linear_head_dim=16, linear_num_heads=4, hc_mult=2, index_kpool=4, pad_token_id=None,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
    )
    cfg.update(overrides)
    return cfg


def hf_config(**overrides) -> Glm5NextTextConfig:
    cfg = Glm5NextTextConfig(**tiny_text_config(**overrides))
    cfg._attn_implementation = "eager"
    return cfg


def our_args(cfg: Glm5NextTextConfig, **overrides) -> Glm5ModelArgs:
    return Glm5ModelArgs.from_hf_config(cfg.to_dict(), **overrides)


@torch.no_grad()
def randomize_(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random values for every parameter and the router bias, so no init coincidence hides a bug."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        is_norm_weight = name.endswith("norm.weight") or name.endswith("layernorm.weight")
        p.copy_(noise * (0.3 if p.ndim == 1 else 0.1) + (1.0 if is_norm_weight else 0.0))
    for name, b in module.named_buffers():
        if "e_score_correction_bias" in name:
            b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return module


def load_from_hf(ours: torch.nn.Module, hf: torch.nn.Module, prefix: str = "") -> None:
    state = {k[len(prefix):]: v for k, v in hf.state_dict().items() if k.startswith(prefix)}
    ours.load_state_dict(hf_to_ours(state), strict=True)


def indices_to_mask(indices: torch.Tensor) -> torch.Tensor:
    """[B, T, K] token indices (-1 = none) -> the [B, T, T] boolean mask they select."""
    bsz, seqlen, _ = indices.shape
    mask = torch.zeros(bsz, seqlen, seqlen + 1, dtype=torch.bool, device=indices.device)
    mask.scatter_(-1, torch.where(indices >= 0, indices.long(), seqlen), True)
    return mask[..., :seqlen]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5) -> None:
    """Relative to the largest magnitude of the expected tensor (max-norm relative error)."""
    scale = expected.abs().max().clamp_min(1e-12)
    err = ((actual - expected).abs().max() / scale).item()
    assert err <= rtol, f"max relative error {err:.3e} > {rtol:.1e}"


__all__ = ["hf_mod", "hf_config", "our_args", "randomize_", "hf_to_ours", "load_from_hf", "assert_close",
           "tiny_text_config", "indices_to_mask"]
