"""activation_checkpoint.kda_disable_recompute (issue 12, the KDA block's speed): the KDA op keeps FLA's forward
intermediates for its backward (FLA's disable_recompute). The kernels run only on CUDA (tests/gpu/test_kda_fla.py
checks values and gradients there); on CPU: the config's rules, that the setting reaches every KDA op of the
trainer's model, the op's refusal of document ids, and that the planner counts the bytes the op's residuals take
(the fake implementation's CUDA shapes, which opcheck matches against FLA's on the GPU)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import torchtitan_glm.ops.kda  # noqa: F401  (registers torchtitan_glm::kda_fwd)
from torchtitan_glm.activation_checkpoint import apply_activation_checkpointing
from torchtitan_glm.config import ConfigError, load_config
from torchtitan_glm.models.glm5 import Glm5Model, get_flavor
from torchtitan_glm.models.glm5.kda import KimiDeltaAttention
from torchtitan_glm.ops.kda import kda
from torchtitan_glm.planner.activations import ActContext, saved

KEY = "activation_checkpoint.kda_disable_recompute"
DEBUG = ["--config", "train_configs/debug_model.toml"]


def test_the_config_takes_it_only_without_document_ids_and_context_parallelism():
    cfg = load_config([*DEBUG, f"--{KEY}", "true", "--data.document_masking", "false"])
    assert cfg.activation_checkpoint.kda_disable_recompute
    with pytest.raises(ConfigError, match=f"{KEY}.*data.document_masking = false"):
        load_config([*DEBUG, f"--{KEY}", "true"])
    with pytest.raises(ConfigError, match=f"{KEY}.*context_parallel_degree = 1, not 2"):
        load_config([*DEBUG, f"--{KEY}", "true", "--data.document_masking", "false",
                     "--parallelism.context_parallel_degree", "2"])


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_every_kda_op_of_the_model_saves_its_states(mode):
    with torch.device("meta"):
        model = Glm5Model(get_flavor("debug"))
    kdas = [m for m in model.modules() if isinstance(m, KimiDeltaAttention)]
    assert kdas and not any(m.save_states for m in kdas)
    apply_activation_checkpointing(model, mode=mode, kda_disable_recompute=True)
    after = [m for m in model.modules() if isinstance(m, KimiDeltaAttention)]
    assert len(after) == len(kdas) and all(m.save_states for m in after)


def test_document_ids_are_refused_naming_the_setting():
    q = torch.randn(1, 16, 2, 8)
    g = -torch.rand(1, 16, 2, 8)
    beta = torch.rand(1, 16, 2)
    seq_idx = torch.tensor([[0] * 8 + [1] * 8])
    with pytest.raises(ValueError, match=KEY):
        kda(q, q, q, g, beta, seq_idx, safe_gate=True, save_states=True)
    without = kda(q, q, q, g, beta, None, safe_gate=True, save_states=False)
    assert torch.equal(kda(q, q, q, g, beta, None, safe_gate=True, save_states=True), without)  # CPU: same math


@pytest.mark.parametrize("tp", [1, 2])
def test_the_planner_counts_the_bytes_the_op_keeps(tp):
    """What the planner adds per KDA block (selective AC and no AC keep the op's outputs) equals the bytes of the
    extra residuals the op returns on CUDA, as its fake implementation builds them (T a multiple of 64)."""
    args = get_flavor("debug")
    b, t, h, k = 2, 256, args.linear_num_heads // tp, args.linear_head_dim
    with FakeTensorMode():
        q = torch.empty(b, t, h, k, device="cuda", dtype=torch.bfloat16)
        g = torch.empty(b, t, h, k, device="cuda", dtype=torch.float32)
        beta = torch.empty(b, t, h, device="cuda", dtype=torch.bfloat16)
        kept = {flag: sum(r.numel() * r.element_size()
                          for r in torch.ops.torchtitan_glm.kda_fwd(q, q, q, g, beta, None, True, flag)[1])
                for flag in (False, True)}
    extra = kept[True] - kept[False]
    assert extra > 0
    for regime in ("eager", "compiled", "selective"):
        planned = {flag: sum(saved("kda_dense", regime, ActContext(args=args, batch=b, seq=t, keys=t, tp=tp,
                                                                   kda_saved_states=flag)).values())
                   for flag in (False, True)}
        assert planned[True] - planned[False] == pytest.approx(extra, rel=1e-9), regime
    # full AC keeps only the block's inputs: nothing more
    full = {flag: sum(saved("kda_dense", "full", ActContext(args=args, batch=b, seq=t, keys=t, tp=tp,
                                                            kda_saved_states=flag)).values())
            for flag in (False, True)}
    assert full[True] == full[False]
