"""[parallelism] layouts: degrees resolve against the world size, and every bad layout is a ConfigError naming the
keys (the trainer raises them before any process group starts)."""

import pytest

from torchtitan_glm.config import ConfigError, ParallelismConfig, load_config
from torchtitan_glm.distributed.parallel_dims import ParallelDims, validate_model_layout
from torchtitan_glm.models.glm5 import get_flavor


def dims(world, **kw):
    return ParallelDims.from_config(ParallelismConfig(**kw), world_size=world)


def test_degrees_resolve():
    d = dims(8, tensor_parallel_degree=2)
    assert (d.dp_replicate, d.dp_shard, d.cp, d.tp, d.ep) == (1, 4, 1, 2, 1)
    d = dims(16, data_parallel_replicate_degree=2, context_parallel_degree=2, expert_parallel_degree=4)
    assert (d.dp_shard, d.dp, d.dp_cp, d.edp) == (4, 8, 16, 4)
    assert dims(1).dp_shard == 1


@pytest.mark.parametrize("world,kw,key,words", [
    (4, dict(data_parallel_shard_degree=3), "parallelism.data_parallel_shard_degree", "is not the world size 4"),
    (3, dict(tensor_parallel_degree=2), "tensor_parallel_degree", "does not divide the world size 3"),
    (4, dict(expert_parallel_degree=3), "parallelism.expert_parallel_degree", "must divide"),
    (8, dict(context_parallel_degree=2, expert_parallel_degree=3), "parallelism.expert_parallel_degree", "multiple"),
])
def test_bad_world_layouts_name_the_keys(world, kw, key, words):
    with pytest.raises(ConfigError, match=words) as e:
        dims(world, **kw)
    assert key in e.value.key


@pytest.mark.parametrize("world,kw,seq_len,key,words", [
    (8, dict(tensor_parallel_degree=8), 64, "parallelism.tensor_parallel_degree", "linear_num_heads"),
    (6, dict(expert_parallel_degree=3), 64, "parallelism.expert_parallel_degree", "n_routed_experts \\(8\\)"),
    (2, dict(context_parallel_degree=2), 72, "training.seq_len", "2 x 2 x 4 = 16"),
])
def test_bad_model_layouts_name_the_keys(world, kw, seq_len, key, words):
    with pytest.raises(ConfigError, match=words) as e:
        validate_model_layout(dims(world, **kw), get_flavor("debug"), seq_len=seq_len)
    assert e.value.key == key


def test_expert_fsdp_needs_rows_that_split_over_the_expert_holders():
    """6 ranks, ep 2: 3 ranks hold each expert set, and the debug model's moe_intermediate_size (32) does not split in
    3; with expert_fsdp off, or 4 holders (8 ranks), the layout is fine."""
    with pytest.raises(ConfigError, match="moe_intermediate_size \\(32\\)") as e:
        validate_model_layout(dims(6, expert_parallel_degree=2), get_flavor("debug"), seq_len=64, expert_fsdp=True)
    assert e.value.key == "parallelism.expert_fsdp"
    validate_model_layout(dims(6, expert_parallel_degree=2), get_flavor("debug"), seq_len=64, expert_fsdp=False)
    validate_model_layout(dims(8, expert_parallel_degree=2), get_flavor("debug"), seq_len=64, expert_fsdp=True)


def test_good_model_layouts_pass():
    for world, kw in ((4, dict(tensor_parallel_degree=4)), (8, dict(expert_parallel_degree=8)),
                      (4, dict(context_parallel_degree=2))):
        validate_model_layout(dims(world, **kw), get_flavor("debug"), seq_len=64)


def test_section_rejects_bad_degrees():
    with pytest.raises(ConfigError, match="parallelism.tensor_parallel_degree"):
        load_config(["--parallelism.tensor_parallel_degree", "0"])
