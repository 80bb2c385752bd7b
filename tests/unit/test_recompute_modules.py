"""[activation_checkpoint] recompute_modules (issue 12): every choice gives the loss and gradients of no
recomputation (fp32, CPU, eager), and holds fewer bytes of activations between forward and backward than plain
selective, which holds fewer than no checkpointing. Bytes held = the storages created during the forward that are
still alive when it returns (what autograd and the checkpoint cache keep). Compiled: tests/compile/
test_recompute_compiled.py. Config errors: here too."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.compile.builders import build_model, make_batch, train_forward, training_loss
from torchtitan_glm.activation_checkpoint import RECOMPUTE_MODULES, apply_activation_checkpointing


class _Created(TorchDispatchMode):
    """Records the storage of every tensor an op creates."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[StorageWeakRef, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                s = t.untyped_storage()
                self.storages.setdefault(StorageWeakRef(s), s.nbytes())
        return out

    def alive_bytes(self) -> int:
        return sum(n for ref, n in self.storages.items() if not ref.expired())


def _step(mode: str, modules: tuple[str, ...]):
    model = build_model(0)
    apply_activation_checkpointing(model, mode=mode, recompute_modules=modules)
    batch = make_batch(0, model.args.vocab_size, bsz=1)
    n = int((batch.labels != -100).sum())
    with _Created() as created:
        out = train_forward(model, batch, token_scale=1.0 / n, mtp_scale=0.1 / n)
        loss = training_loss(out)
    held = created.alive_bytes()
    loss.backward()
    grads = {name.replace("._checkpoint_wrapped_module", ""): p.grad for name, p in model.named_parameters()
             if p.grad is not None}
    sites = [getattr(m, "recompute_sites", None) for m in list(model.layers.values()) + [model.mtp]]
    seen = set().union(*(s.seen for s in sites if s is not None)) if modules else set()
    return loss.detach(), grads, held, seen


@pytest.fixture(scope="module")
def baselines():
    return {mode: _step(mode, ()) for mode in ("none", "selective")}


@pytest.mark.parametrize("name", RECOMPUTE_MODULES)
def test_each_choice_is_exact_and_holds_less(baselines, name):
    ref_loss, ref_grads, none_bytes, _ = baselines["none"]
    _, _, selective_bytes, _ = baselines["selective"]
    loss, grads, held, seen = _step("selective", (name,))
    assert seen == {name}, f"the policy attributed ops to {seen}"
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert grads.keys() == ref_grads.keys()
    for key, g in grads.items():
        torch.testing.assert_close(g, ref_grads[key], rtol=1e-5, atol=1e-7, msg=lambda m: f"{key}: {m}")
    assert selective_bytes < none_bytes
    assert held < selective_bytes, f"{name}: {held} bytes held, selective alone {selective_bytes}"


def test_all_choices_together_hold_least(baselines):
    _, _, selective_bytes, _ = baselines["selective"]
    kda_only = _step("selective", ("kda",))[2]
    _, _, together, seen = _step("selective", RECOMPUTE_MODULES)
    assert seen == set(RECOMPUTE_MODULES)
    assert together < kda_only < selective_bytes


def test_megatron_moe_act_is_what_selective_does(baselines):
    """A Megatron config's "moe_act" is accepted and holds exactly plain selective's bytes (selective recomputes the
    experts' SwiGLU already)."""
    from torchtitan_glm.config import ActivationCheckpointConfig

    ActivationCheckpointConfig(mode="selective", recompute_modules=["moe_act", "kda"]).validate()
    loss, grads, held, _ = _step("selective", ("moe_act",))
    ref_loss, ref_grads, selective_bytes, _ = baselines["selective"]
    assert held == selective_bytes and torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)


@pytest.mark.parametrize("keys,fragment", [
    ({"mode": "full", "recompute_modules": ["kda"]}, "refines mode 'selective'"),
    ({"mode": "none", "recompute_modules": ["kda"]}, "refines mode 'selective'"),
    ({"mode": "selective", "recompute_modules": ["attention"]}, "unknown module 'attention'"),
    ({"mode": "selective", "recompute_modules": ["kda", "kda"]}, "duplicates"),
])
def test_bad_recompute_modules_name_the_key(keys, fragment):
    from torchtitan_glm.config import ActivationCheckpointConfig, ConfigError

    with pytest.raises(ConfigError) as e:
        ActivationCheckpointConfig(**keys).validate()
    assert e.value.key == "activation_checkpoint.recompute_modules" and fragment in str(e.value)


def test_recompute_modules_from_toml_and_cli(tmp_path):
    from torchtitan_glm.config import ConfigError, load_config

    path = tmp_path / "ac.toml"
    path.write_text('[activation_checkpoint]\nmode = "selective"\nrecompute_modules = ["kda", "mla_up_proj"]\n')
    cfg = load_config(["--config", str(path)])
    assert list(cfg.activation_checkpoint.recompute_modules) == ["kda", "mla_up_proj"]
    assert 'recompute_modules = ["kda", "mla_up_proj"]' in cfg.to_toml()
    path.write_text('[activation_checkpoint]\nmode = "selective"\nrecompute_modules = ["kda", "attn"]\n')
    with pytest.raises(ConfigError) as e:
        load_config(["--config", str(path)])
    assert e.value.key == "activation_checkpoint.recompute_modules" and "'attn'" in str(e.value)


class _GroupedForwards(TorchDispatchMode):
    """Counts the routed experts' forward grouped GEMMs (torchtitan_glm::grouped_mm)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops.torchtitan_glm.grouped_mm.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode,chunk,again", [("none", 0, 0), ("selective", 0, 1), ("full", 0, 1),
                                              ("none", 8, 1), ("selective", 8, 2), ("full", 8, 2)])
def test_how_often_the_routed_experts_run_again_in_backward(mode, chunk, again):
    """What the docs and the planner's step time say: selective and full AC re-run the routed experts' forward once
    in backward (selective does not save their grouped GEMMs), and moe_chunk_tokens once more (a chunk's backward
    re-runs its chunk). Backward runs one grouped_mm per forward one anyway: the input gradient."""
    model = build_model(0)
    apply_activation_checkpointing(model, mode=mode, moe_chunk_tokens=chunk)
    batch = make_batch(0, model.args.vocab_size, bsz=1)
    n = int((batch.labels != -100).sum())
    with _GroupedForwards() as forward:
        loss = training_loss(train_forward(model, batch, token_scale=1.0 / n, mtp_scale=0.1 / n))
    with _GroupedForwards() as backward:
        loss.backward()
    assert forward.calls > 0 and backward.calls == (1 + again) * forward.calls, (forward.calls, backward.calls)
    from torchtitan_glm.activation_checkpoint import _save_list

    assert not any("grouped_mm" in str(op) for op in _save_list())
