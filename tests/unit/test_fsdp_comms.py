"""parallelism.fsdp_reduce_in_compute_pool (distributed/fsdp_comms.py): FSDP2's reduce buffers from the compute
stream's pool. On CPU there are no streams, so what is checked here is that the comm is installed and used, that
training is bit-identical with it, that the key is refused where parameters are split, and the planner's reserve.
On a GPU: tests/gpu/test_fsdp_comms_cuda.py."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_host_syncs import _trainer
from torchtitan_glm.config import ConfigError, load_config


def _train(tmp_path, monkeypatch, *overrides: str):
    """Losses, final parameters and the installed comm (None when off) of a 3-step debug run on one rank."""
    import torchtitan_glm.models.glm5.parallelize as parallelize

    installed = []

    def spy(model, **kw):
        installed.append(use(model, **kw))
        return installed[-1]

    use = parallelize.use_compute_pool_reduce
    monkeypatch.setattr(parallelize, "use_compute_pool_reduce", spy)
    trainer = _trainer(tmp_path, "--training.steps", "3", "--metrics.log_freq", "1", "--compile.enable", "false",
                       *overrides)
    losses = trainer.train()
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in trainer.model.named_parameters()}
    trainer.close()
    return losses, params, installed[0] if installed else None


@pytest.mark.parametrize("accumulate", [(), ("--training.global_batch_size", "2",
                                              "--parallelism.fsdp_reshard_after_forward", "never")],
                         ids=["one_batch", "two_microbatches"])
def test_training_is_identical_with_the_reduce_in_the_compute_pool(tmp_path, world_of_one, monkeypatch, accumulate,
                                                                   caplog):
    off = _train(tmp_path / "off", monkeypatch, *accumulate, "--parallelism.fsdp_reduce_in_compute_pool", "false")
    on = _train(tmp_path / "on", monkeypatch, *accumulate, "--parallelism.fsdp_reduce_in_compute_pool", "true")
    caplog.clear()
    with caplog.at_level("INFO"):
        unset = _train(tmp_path / "unset", monkeypatch, *accumulate)  # the default: on, where no parameter is split
    assert "FSDP2's reduce buffers from the compute stream's pool" in caplog.text  # the start-up summary says so
    assert off[2] is None and on[2] is not None and unset[2] is not None
    assert unset[0] == on[0]
    # the reduce's input and output of every unit, every step: at least the FP32 gradients of all parameters
    grads = sum(p.numel() * 4 for p in on[1].values())
    assert on[2].allocated >= 3 * grads, (on[2].allocated, grads)
    assert on[0] == off[0]
    for name, p in off[1].items():
        assert torch.equal(on[1][name], p), name


def _cfg(*overrides: str):
    return load_config(["--config", "train_configs/debug_model.toml", *overrides])


def test_the_key_is_refused_where_parameters_are_split(monkeypatch):
    from torchtitan_glm.train import check_layout

    key = "--parallelism.fsdp_reduce_in_compute_pool"
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"parallelism\.fsdp_reduce_in_compute_pool.*data_parallel_shard 2"):
        check_layout(_cfg(key, "true"))
    check_layout(_cfg(key, "true", "--parallelism.data_parallel_replicate_degree", "2"))  # replicas: a copy
    check_layout(_cfg())  # unset: off there, no error
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match=r"cpu_offload"):
        check_layout(_cfg(key, "true", "--optimizer.cpu_offload", "true"))


def test_unset_means_wherever_it_applies():
    from torchtitan_glm.distributed.fsdp_comms import compute_pool_wanted

    assert compute_pool_wanted(None, splits_parameters=False, cpu_offload=False)
    assert not compute_pool_wanted(None, splits_parameters=True, cpu_offload=False)
    assert not compute_pool_wanted(None, splits_parameters=False, cpu_offload=True)
    assert not compute_pool_wanted(False, splits_parameters=False, cpu_offload=False)
    assert compute_pool_wanted(True, splits_parameters=False, cpu_offload=False)
    assert compute_pool_wanted(True, splits_parameters=True, cpu_offload=False)  # as set: train.py refuses it


def test_the_planner_keeps_no_gradients_apart_with_it():
    """The proxy on one H200: without the key the previous step's sharded gradients stay in the reduce stream's
    pool until this step's reduces reuse them; accumulating 8 rows under a deferred reduce, all of them are apart
    at the peak (the measured 131.96 GiB reserve, planned 137.0). With the key none are; nothing else changes."""
    from torchtitan_glm.planner import Request, plan
    from torchtitan_glm.planner.hardware import H200

    for extra in ((), ("--training.global_batch_size=8", "--parallelism.fsdp_reshard_after_forward=never")):
        argv = ("--config", "train_configs/glm5_3_flash_proxy.toml", *extra)
        off = plan(Request((*argv, "--parallelism.fsdp_reduce_in_compute_pool=false"), 1, H200, "train"))
        on = plan(Request((*argv, "--parallelism.fsdp_reduce_in_compute_pool=true"), 1, H200, "train"))
        assert plan(Request(argv, 1, H200, "train")).memory.reserved == on.memory.reserved  # unset: on here
        assert on.memory.peak == off.memory.peak and on.time.step_s == off.time.step_s
        assert on.memory.reserved < off.memory.reserved and on.fits
        if extra:
            grads = off.memory.state.grads - off.memory.state.replicated_grads
            assert off.memory.reserved - on.memory.reserved == pytest.approx(grads, rel=0.02)
            assert not off.fits  # over the 90% budget by its reserve
    # where parameters are split the planner refuses it as train.py does (its layout check is the trainer's)
    split = ("--config", "train_configs/debug_model.toml", "--parallelism.fsdp_reduce_in_compute_pool=true")
    with pytest.raises(ConfigError, match=r"fsdp_reduce_in_compute_pool"):
        plan(Request(split, 2, H200, "train"))
