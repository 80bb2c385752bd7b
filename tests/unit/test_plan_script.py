"""scripts/plan.py: layouts the trainer rejects are rejected with the trainer's own messages (exit 2), --what-if plans
them and carries the message, the --json schema (core.PLAN_FIELDS) is what the script prints, and the FLOPs are the
trainer's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_glm.components.metrics import flops_per_token
from torchtitan_glm.config import ConfigError, load_config
from torchtitan_glm.planner.core import MEMORY_FIELDS, PLAN_FIELDS, SCHEMA, SEARCH_SCHEMA, TIME_FIELDS
from torchtitan_glm.train import build_model_args, check_layout

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from plan import run  # noqa: E402

DEBUG = ["--config", "train_configs/debug_model.toml"]


def _trainer_error(argv: list[str], world: int, monkeypatch) -> str:
    """What train.py says for these arguments on `world` ranks: its config, then its layout check (main() runs both
    before any process group, with torchrun's WORLD_SIZE)."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    try:
        check_layout(load_config(argv))
    except (ConfigError, ValueError) as e:
        return str(e)
    finally:
        monkeypatch.delenv("WORLD_SIZE")
    raise AssertionError(f"the trainer accepts {argv} on {world} ranks")


@pytest.mark.parametrize("layout", [
    ["--parallelism.data_parallel_shard_degree", "3"],  # the degrees' product is not the world size
    ["--parallelism.data_parallel_shard_degree", "0"],  # a bad value: ParallelismConfig.validate
    ["--parallelism.expert_parallel_degree", "3"],  # does not divide the layout (ParallelDims) / the experts
    ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.context_parallel_degree", "2"],  # not wired yet
])
def test_rejected_with_the_trainers_message(layout, monkeypatch):
    with pytest.raises((ConfigError, ValueError)) as err:
        run([*DEBUG, "--gpus", "2", *layout])
    assert str(err.value) == _trainer_error([*DEBUG, *layout], 2, monkeypatch)


def test_script_exits_2_with_the_message(monkeypatch):
    layout = ["--parallelism.data_parallel_shard_degree", "3"]
    res = subprocess.run([sys.executable, "scripts/plan.py", *DEBUG, "--gpus", "2", *layout], cwd=ROOT,
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1"))
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.strip().endswith(f"error: {_trainer_error([*DEBUG, *layout], 2, monkeypatch)}")


def _check(obj: dict, fields: dict) -> None:
    assert set(obj) == set(fields), set(obj) ^ set(fields)
    for key, (types, _) in fields.items():
        assert isinstance(obj[key], types), (key, obj[key])


def test_json_schema_and_trainer_flops():
    out = json.loads(run([*DEBUG, "--gpus", "2", "--json"]))
    _check(out, PLAN_FIELDS)
    _check(out["memory"], MEMORY_FIELDS)
    _check(out["time"], TIME_FIELDS)
    assert out["schema"] == SCHEMA and out["trainer_accepts"] and out["trainer_message"] is None
    assert out["layout"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "ep": 1, "cp": 1, "expert_fsdp": False}
    assert out["design"] == "parallelize.py"
    cfg = load_config([*DEBUG])
    assert out["time"]["flops_per_token"] == flops_per_token(build_model_args(cfg), cfg.training.seq_len)
    assert out["tokens_per_step"] == 2 * cfg.training.local_batch_size * cfg.training.seq_len
    for c in out["collectives"]:
        assert set(c) == {"name", "group", "calls", "bytes_per_rank", "link", "seconds", "overlapped"}
    mem = out["memory"]
    assert mem["peak_gib"] == pytest.approx(sum(mem["breakdown_gib"].values()), abs=0.01)


def test_what_if_plans_a_rejected_layout_and_keeps_the_message(monkeypatch):
    layout = ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.context_parallel_degree", "2"]
    out = json.loads(run([*DEBUG, "--gpus", "2", "--json", "--what-if", *layout]))
    assert not out["trainer_accepts"]
    assert out["trainer_message"] == _trainer_error([*DEBUG, *layout], 2, monkeypatch)
    assert out["layout"]["cp"] == 2 and any(c["name"] == "cp kda state chain" for c in out["collectives"])


def test_expert_parallel_plan(monkeypatch):
    """EP over both ranks (accepted by the trainer): the experts leave FSDP2, so no expert is all-gathered; their
    gradients are all-reduced over the expert-data group (size 1 here: none) and the tokens go all-to-all."""
    base = json.loads(run([*DEBUG, "--gpus", "2", "--json"]))
    out = json.loads(run([*DEBUG, "--gpus", "2", "--json", "--parallelism.expert_parallel_degree", "2"]))
    assert out["trainer_accepts"] and out["layout"]["ep"] == 2
    # 8 experts: 4 whole ones per rank (out of FSDP2) instead of half of each -- the same bytes
    assert out["memory"]["state_bytes"]["params"] == base["memory"]["state_bytes"]["params"]
    assert out["memory"]["state_bytes"]["replicated_params"] > base["memory"]["state_bytes"]["replicated_params"]
    gathered = lambda plan: sum(c["bytes_per_rank"] for c in plan["collectives"] if c["name"] == "fsdp all-gather")  # noqa: E731
    assert gathered(out) < gathered(base)
    assert any(c["name"] == "ep all-to-all" for c in out["collectives"])


def test_search_json(monkeypatch):
    out = json.loads(run([*DEBUG, "--gpus", "2", "--search", "--json", "--ac", "none,full", "--top", "50"]))
    assert out["schema"] == SEARCH_SCHEMA and out["gpus"] == 2
    accepted = out["candidates"] - out["rejected_by_trainer"]
    assert 1 <= accepted < out["candidates"]  # context parallelism is rejected today
    assert out["planned"] == 2 * accepted  # two AC modes each
    speeds = [p["time"]["tokens_per_s"] for p in out["top"]]
    assert speeds == sorted(speeds, reverse=True) and all(p["memory"]["fits"] for p in out["top"])
    assert all(p["trainer_accepts"] for p in out["top"])


def test_expert_fsdp_what_if():
    """--expert-fsdp: the same EP layout with the experts FSDP2-sharded over the expert-data ranks (4 ranks, ep 2:
    two ranks per expert set) holds half the expert bytes of parallelize.py's whole experts, all-gathers them, and is
    marked as a what-if."""
    layout = ["--parallelism.expert_parallel_degree", "2"]
    whole = json.loads(run([*DEBUG, "--gpus", "4", "--json", *layout]))
    sharded = json.loads(run([*DEBUG, "--gpus", "4", "--json", "--expert-fsdp", *layout]))
    assert whole["design"] == "parallelize.py" and sharded["design"].startswith("what-if")
    assert sharded["memory"]["state_bytes"]["params"] < whole["memory"]["state_bytes"]["params"]
    assert any(c["name"] == "fsdp all-gather (experts)" for c in sharded["collectives"])
    assert any(c["name"] == "expert grad all-reduce" for c in whole["collectives"])
    assert not any(c["name"] == "expert grad all-reduce" for c in sharded["collectives"])
