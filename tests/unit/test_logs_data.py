"""components/logs.py: the start-up summary's data row (how much data one epoch holds, how many epochs the run
covers) and the warning when one global batch holds more rows than an epoch; init_logging's filter of known-benign
third-party warnings."""

from __future__ import annotations

import logging
import re

import numpy as np
import torch

from torchtitan_glm.components.data import build_dataloader
from torchtitan_glm.components.logs import data_line, startup_summary
from torchtitan_glm.components.tokenizer import ByteTokenizer
from torchtitan_glm.config import DataConfig, load_config
from torchtitan_glm.models.glm5 import Glm5Model, get_flavor

TOK = ByteTokenizer()


def _bin(path, n_tokens, eos_every):
    toks = np.arange(n_tokens) % 200
    toks[eos_every - 1::eos_every] = TOK.eos_id
    toks.astype("uint16").tofile(path)
    return str(path)


def _summary(cfg, dataloader, *, dp_size=2):
    model = Glm5Model(get_flavor("debug"))
    text = startup_summary(cfg=cfg, args=model.args, model=model, world=dp_size, dp_size=dp_size,
                           device=torch.device("cpu"), resume="fresh start", dataloader=dataloader)
    return dict(re.findall(r"^  (\S+(?: \S+)?)\s{2,}(.+)$", text, flags=re.M))


def test_summary_has_a_data_row_counting_epochs(tmp_path, caplog):
    """A .bin file of 200 documents of 10 tokens: 2000 tokens, 15 whole rows of 129; 3 steps x 8 rows = 1.6
    epochs; no warning (a global batch of 8 rows is less than an epoch)."""
    path = _bin(tmp_path / "r.bin", 2000, 10)
    cfg = load_config(["--config", "train_configs/debug_model.toml", "--data.source", "bin", "--data.paths", path,
                       "--training.steps", "3", "--lr_scheduler.warmup_steps", "1"])
    loader = build_dataloader(cfg=cfg.data, tokenizer=TOK, seq_len=128, local_batch_size=4, dp_rank=0,
                              dp_world_size=2, seed=0)
    with caplog.at_level(logging.WARNING, logger="torchtitan_glm"):
        rows = _summary(cfg, loader)
    assert rows["data"] == (f"bin ({path}): 200 documents, 2.00K tokens, 15 rows of 129 tokens per epoch; 3 steps x "
                            "8 rows = 1.6 epochs")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_global_batch_larger_than_an_epoch_is_warned(tmp_path, caplog):
    """A jsonl corpus of 500 tokens (3.9 rows of 129) read 8 rows per step: the WARNING says each step repeats rows."""
    (tmp_path / "d.jsonl").write_text("".join('{"text": "%s"}\n' % ("x" * 99) for _ in range(5)))
    cfg = load_config(["--config", "train_configs/debug_model.toml", "--data.source", "jsonl", "--data.paths",
                       str(tmp_path / "d.jsonl"), "--training.steps", "10"])
    loader = build_dataloader(cfg=cfg.data, tokenizer=TOK, seq_len=128, local_batch_size=4, dp_rank=0,
                              dp_world_size=2, seed=0)
    with caplog.at_level(logging.WARNING, logger="torchtitan_glm"):
        rows = _summary(cfg, loader)
    assert rows["data"].endswith("5 documents, 500 tokens, 3.9 rows of 129 tokens per epoch; 10 steps x 8 rows = "
                                 "20.6 epochs")  # 80 rows / (500 / 129)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "one global batch (8 rows of 129 tokens) holds more rows than an epoch" in warnings[0]


def test_data_line_of_many_files_and_of_builtin(tmp_path):
    data = {"source": "txt", "files": [f"d/{i}.txt" for i in range(5)], "documents": 5, "tokens": 1290,
            "rows_per_epoch": 10.0, "row_len": 129, "global_batch_rows": 4}
    line, warning = data_line(data, steps=5, global_batch_rows=4)
    assert line.startswith("txt (d/0.txt, d/1.txt, d/2.txt, ... (5 files)): 5 documents") and warning is None
    builtin = build_dataloader(cfg=DataConfig(), tokenizer=TOK, seq_len=128, local_batch_size=1, dp_rank=0,
                               dp_world_size=1, seed=0).summary()
    line, _ = data_line(builtin, steps=1, global_batch_rows=1)
    assert re.match(r"builtin \(\d+ standard-library files\): [\d,]+ documents", line)
    assert "causal sequence" not in line
    plain = build_dataloader(cfg=DataConfig(document_masking=False), tokenizer=TOK, seq_len=128, local_batch_size=1,
                             dp_rank=0, dp_world_size=1, seed=0).summary()
    line, _ = data_line(plain, steps=1, global_batch_rows=1)
    assert line.endswith("epochs; each row one causal sequence (data.document_masking false)")


def test_init_logging_drops_only_the_known_benign_third_party_warnings(caplog):
    """torchao's extension-load failures and torch's pytree Enum note are dropped after init_logging (twice: the
    filter is added once); the same loggers' other warnings still reach the handlers."""
    from torchtitan_glm.components.logs import init_logging

    init_logging(rank=0)
    init_logging(rank=0)
    ao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    assert sum(type(f).__name__ == "_DropBenign" for f in ao.filters) == 1
    with caplog.at_level(logging.WARNING):
        ao.warning("Failed to load /x/torchao/_C_mxfp8.so: Could not load this library")
        pytree.warning("%s is an Enum subclass and is now natively supported by torch.compile as an opaque value "
                       "type. Calling register_constant() on Enum subclasses is deprecated", "<enum 'K'>")
        ao.warning("torchao: something else went wrong")
        ao.warning("Failed to load the quantization config: bad file")  # not an extension: kept
        pytree.warning("another pytree warning")
    assert [r.getMessage() for r in caplog.records] == ["torchao: something else went wrong",
                                                        "Failed to load the quantization config: bad file",
                                                        "another pytree warning"]
