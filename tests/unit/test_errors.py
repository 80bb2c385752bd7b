"""How run_job ends a process for each kind of failure: the exit code and the one line it prints (single process;
the multi-rank behaviour is tests/distributed/test_reliability.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.distributed.test_train import ROOT

_SCRIPT = textwrap.dedent("""
    import sys
    from torchtitan_glm.components.errors import CheckpointError, DataError, ResumeMismatchError, run_job
    from torchtitan_glm.components.tokenizer import ByteTokenizer, check_vocab_fits
    from torchtitan_glm.config import ConfigError
    from torchtitan_glm.models.glm5.args import ModelArgsError

    errors = {"config": ConfigError("training.steps", "must be >= 1"),
              "model_args": ModelArgsError("model arg `n_group`: must be >= 1", key="n_group"),
              "resume": ResumeMismatchError("cannot resume: training.seq_len was 64, is 32"),
              "checkpoint": CheckpointError("checkpoint /x is corrupt"),
              "data": DataError("/d.jsonl:3: invalid JSON"),
              "unexpected": RuntimeError("boom")}

    def fail():
        if sys.argv[1] == "vocab":
            check_vocab_fits(ByteTokenizer(), vocab_size=100, model="model.vocab_size")
        raise errors[sys.argv[1]]

    run_job(fail)
""")


@pytest.mark.parametrize("kind, code, line", [
    ("config", 2, "error: config error at `training.steps`: must be >= 1"),
    ("model_args", 2, "error: model arg `n_group`: must be >= 1"),
    ("resume", 2, "error: cannot resume: training.seq_len was 64, is 32"),
    ("checkpoint", 1, "error: checkpoint /x is corrupt"),
    ("data", 1, "error: /d.jsonl:3: invalid JSON"),
    ("unexpected", 1, "error on rank 0, unexpected:"),
    ("vocab", 2, "error: data.tokenizer byte has 259 tokens but the model (model.vocab_size) has vocab_size 100: use "
                 "a tokenizer that fits or a model with a larger vocab_size"),
])
def test_exit_code_and_line_by_kind(kind, code, line):
    """A setting to change (config, model argument, a resume the settings cannot continue) exits 2, as the config
    loader does before start-up; other failures exit 1. Without a process group the line names no rank."""
    res = subprocess.run([sys.executable, "-c", _SCRIPT, kind], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == code, res.stderr[-2000:]
    assert res.stderr.splitlines()[0] == line, res.stderr[-2000:]
