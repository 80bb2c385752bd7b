"""parallelism.fsdp_reshard_after_forward: each policy reaches FSDP2's units (the trainer's model) and the planner's
units, changes no loss (two steps, bit for bit), and moves memory and gathers the way the planner says."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from torchtitan_glm.config import ConfigError, load_config, reshard_after_forward


def _run(tmp_path, policy: str):
    from torchtitan_glm.train import Trainer

    cfg = load_config(["--config", "train_configs/debug_model.toml", "--training.seq_len", "32", "--training.steps",
                       "2", "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false",
                       "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "1", "--compile.enable", "false",
                       f"--parallelism.fsdp_reshard_after_forward={policy}", f"--job.dump_folder={tmp_path / policy}"])
    trainer = Trainer(cfg)
    model = trainer.model
    units = {"layers.0": model.layers["0"], "embed_tokens": model.embed_tokens, "head": model.norm}
    # FSDP2 keeps a post-forward mesh exactly for the units it reshards after forward
    reshards = {name: m._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None
                for name, m in units.items()}
    losses = trainer.train()
    dist.destroy_process_group()
    return reshards, losses


def test_policies_reach_fsdp2_and_train_the_same(tmp_path, world_of_one):
    results = {p: _run(tmp_path, p) for p in ("default", "never", "always")}
    assert results["default"][0] == {"layers.0": True, "embed_tokens": True, "head": False}
    assert results["never"][0] == {"layers.0": False, "embed_tokens": False, "head": False}
    assert results["always"][0] == {"layers.0": True, "embed_tokens": True, "head": True}
    assert results["default"][1] == results["never"][1] == results["always"][1]  # the same numbers, bit for bit


def test_the_policy_is_checked():
    with pytest.raises(ConfigError, match=r"parallelism\.fsdp_reshard_after_forward"):
        load_config(["--config", "train_configs/debug_model.toml", "--parallelism.fsdp_reshard_after_forward",
                     "sometimes"])
    assert [reshard_after_forward(p, head=h) for p in ("default", "always", "never") for h in (False, True)] == [
        True, False, True, True, False, False]


def test_the_planner_follows_the_policy():
    from torchtitan_glm.planner import Request, plan
    from torchtitan_glm.planner.core import build_inventory
    from torchtitan_glm.planner.hardware import H200
    from torchtitan_glm.planner.params import unit_bytes

    argv = ("--config", "train_configs/glm5_3_flash_proxy.toml")
    default = plan(Request(argv, 1, H200, "train"))
    never_argv = (*argv, "--parallelism.fsdp_reshard_after_forward=never")
    never = plan(Request(never_argv, 1, H200, "train"))
    units = build_inventory(load_config(list(never_argv)), scope="train").units
    assert [u.reshard_after_forward for u in units] == [False] * len(units)
    trunk = sum(unit_bytes(u, never.layout, dtype_bytes=2, sharded=False) for u in units if u.kind != "head")
    # held from forward to backward: at the loss, between them, every unit's BF16 parameters but the head's (which
    # the default holds there too) are still gathered: 13.6 GiB here
    at_loss = {name: dict(p.memory.timeline)["forward loss (fused CE)"] for name, p in (("d", default), ("n", never))}
    assert at_loss["n"] - at_loss["d"] == pytest.approx(trunk, rel=1e-6)
    # the peak comes late in backward (FP32 gradients), where most of what was held is free again: it grows, by less
    assert default.memory.peak < never.memory.peak < default.memory.peak + trunk
    # one gather (here a cast) per unit and step instead of two
    assert never.time.compute_s["fsdp_copies"] < default.time.compute_s["fsdp_copies"]
