"""Packed, document-aware, resumable data loading.

Documents come from the running Python's standard-library sources (`builtin`: always present, no download), from
jsonl/txt files, or from a pre-tokenized `.bin` token file (documents separated by eos). Token streams are packed
into rows of seq_len + 1 tokens (inputs row[:-1], labels row[1:]); each batch carries the document structure
(`doc_ids`, `cu_seqlens`) so attention and the KDA state restart at document starts, and the label that would
predict the next document's first token is -100.

Sharding: text documents are dealt to data-parallel ranks from a per-epoch shuffle (seeded); `.bin` rows are dealt
round-robin in file order (pre-tokenized data is assumed already shuffled). The loader is infinite (epochs repeat)
and its state_dict/load_state_dict resume at the next unseen token.

Inputs are checked when the loader is built, before any training: every jsonl line is parsed, txt files are
checked to be UTF-8 (data.errors), and `.bin` token ids are checked against the model's vocab_size (one
memory-mapped pass). Every problem raises DataError naming the file (and line or position).
"""

from __future__ import annotations

import codecs
import json
import logging
import os
import sysconfig
from typing import Any, Iterator

import numpy as np
import torch

from torchtitan_glm.components.errors import DataError
from torchtitan_glm.config import DataConfig

__all__ = ["PackedDataLoader", "build_dataloader", "builtin_corpus_files"]

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_CHUNK_BYTES = 16 << 20  # read size of the up-front checks


# ------------------------------------------------------------------------------------------------ documents
def builtin_corpus_files() -> list[str]:
    """Sorted .py files of this Python's standard library (installed third-party packages excluded)."""
    root = sysconfig.get_paths()["stdlib"]
    files: list[str] = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        files += [os.path.join(folder, n) for n in names if n.endswith(".py")]
    return sorted(files)


def _expand(paths: list[str], suffix: str) -> list[str]:
    """Files as given; directories expanded to their sorted `*suffix` files (recursively)."""
    out: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            found = sorted(os.path.join(d, n) for d, _, ns in os.walk(p) for n in ns if n.endswith(suffix))
            if not found:
                raise DataError(f"data.paths: directory {p} holds no *{suffix} files")
            out += found
        elif os.path.isfile(p):
            out.append(p)
        else:
            raise DataError(f"data.paths: file not found: {p}")
    return out


def _utf8_error(path: str) -> str | None:
    """Where `path` stops being valid UTF-8 (None if it is), read in chunks with an incremental decoder."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    offset = 0
    try:
        with open(path, "rb") as f:
            while True:
                chunk = f.read(_CHUNK_BYTES)
                try:
                    decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as e:
                    return f"byte {offset + e.start} ({e.reason})"
                if not chunk:
                    return None
                offset += len(chunk)
    except OSError as e:
        raise DataError(f"cannot read data file {path}: {e.strerror or e}") from None


def _check_text_files(files: list[str], errors: str, *, log: bool) -> list[str]:
    """The txt files to train on under data.errors: "strict" raises at the first file that is not UTF-8, "skip"
    leaves such files out (with one warning), "replace" keeps everything unchecked."""
    if errors == "replace":
        return files
    bad = [(path, where) for path in files if (where := _utf8_error(path)) is not None]
    if bad and errors == "strict":
        path, where = bad[0]
        raise DataError(f"data file {path} is not valid UTF-8 text (at {where}); is it a text file? Remove it from "
                        "data.paths, convert it, or set data.errors to 'skip' (leave such files out) or 'replace' "
                        "(decode bad bytes as U+FFFD)" + (f"; {len(bad) - 1} more file(s) have the same problem"
                                                          if len(bad) > 1 else ""))
    if bad and log:
        logger.warning("data.errors='skip': leaving out %d of %d txt file(s) that are not valid UTF-8: %s%s",
                       len(bad), len(files), ", ".join(p for p, _ in bad[:5]), " ..." if len(bad) > 5 else "")
    skipped = {p for p, _ in bad}
    return [p for p in files if p not in skipped]


class _FileCorpus:
    """One document per file (stdlib sources, txt files); files are read only when their document is reached.
    errors: the UTF-8 decoding policy ("replace", or "strict" for files checked up front)."""

    def __init__(self, files: list[str], description: str, errors: str = "replace") -> None:
        self.files, self.description, self.errors = files, description, errors

    def __len__(self) -> int:
        return len(self.files)

    def name(self, i: int) -> str:
        return self.files[i]

    def read(self, i: int) -> str:
        try:
            with open(self.files[i], "rb") as f:
                return f.read().decode("utf-8", errors=self.errors)
        except OSError as e:
            raise DataError(f"cannot read data file {self.files[i]}: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise DataError(f"data file {self.files[i]} is not valid UTF-8 text (at byte {e.start}); did it change "
                            "since the start of the run?") from None


def _jsonl_text(raw: bytes, path: str, lineno: int, text_key: str) -> str:
    """The text of one jsonl line; DataError naming `path:lineno` when it is not an object with a string there."""
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}:{lineno}: invalid JSON: {e}; fix or remove that line") from None
    if not isinstance(obj, dict) or text_key not in obj:
        raise DataError(f"{path}:{lineno}: expected a JSON object with key {text_key!r} (data.text_key)")
    text = obj[text_key]
    if not isinstance(text, str):
        raise DataError(f"{path}:{lineno}: {text_key!r} is {type(text).__name__}, expected a string")
    return text


class _JsonlCorpus:
    """One document per non-blank jsonl line. Every line is parsed once up front (a bad line stops the run before
    training, naming its file and line) while an index of (file, byte offset, line number) is built; the text is
    read again when its document is reached."""

    def __init__(self, files: list[str], text_key: str) -> None:
        self.files, self.text_key = files, text_key
        self.description = ", ".join(files)
        file_idx, offsets, lines = [], [], []
        for fi, path in enumerate(files):
            with open(path, "rb") as f:
                pos = 0
                for lineno, line in enumerate(f, start=1):
                    if line.strip():
                        _jsonl_text(line, path, lineno, text_key)
                        file_idx.append(fi)
                        offsets.append(pos)
                        lines.append(lineno)
                    pos += len(line)
        self._file = np.asarray(file_idx, dtype=np.int32)
        self._offset = np.asarray(offsets, dtype=np.int64)
        self._line = np.asarray(lines, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._offset)

    def name(self, i: int) -> str:
        return f"{self.files[self._file[i]]}:{int(self._line[i])}"

    def read(self, i: int) -> str:
        path, lineno = self.files[self._file[i]], int(self._line[i])
        with open(path, "rb") as f:
            f.seek(int(self._offset[i]))
            raw = f.readline()
        return _jsonl_text(raw, path, lineno, self.text_key)


# -------------------------------------------------------------------------------------------- row streams
class _DocStream:
    """This rank's packed rows from a text corpus: documents of a seeded per-epoch permutation, every
    dp_world_size-th one, tokenized when reached. Position = (epoch, cursor into this rank's documents, token offset
    into that document); that position is the whole resumable state."""

    def __init__(self, corpus: Any, tokenizer: Any, *, add_eos: bool, row_len: int, rank: int, world: int,
                 seed: int) -> None:
        if len(corpus) < world:
            raise DataError(f"corpus {corpus.description} has {len(corpus)} documents; each of the {world} "
                             "data-parallel ranks needs at least one (use more files, jsonl, or a .bin file)")
        self.corpus, self.tokenizer, self.add_eos = corpus, tokenizer, add_eos
        self.row_len, self.rank, self.world, self.seed = row_len, rank, world, seed
        self.epoch, self.cursor, self.offset = 0, 0, 0
        self._order_epoch, self._order = -1, np.empty(0, dtype=np.int64)
        self._doc: np.ndarray | None = None
        self._row_docs: list[int] = []

    def row_documents(self) -> list[str]:
        """The documents the last row came from (file, or file:line)."""
        return [self.corpus.name(i) for i in self._row_docs]

    def _docs(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            perm = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.corpus))
            self._order, self._order_epoch = perm[self.rank :: self.world], self.epoch
        return self._order

    def _load_doc(self) -> np.ndarray:
        ids = self.tokenizer.encode(self.corpus.read(int(self._docs()[self.cursor])))
        if self.add_eos:
            ids = list(ids) + [self.tokenizer.eos_id]
        return np.asarray(ids, dtype=np.int64)

    def _advance_doc(self) -> None:
        self._doc, self.offset, self.cursor = None, 0, self.cursor + 1
        if self.cursor == len(self._docs()):
            self.epoch, self.cursor = self.epoch + 1, 0

    def next_row(self) -> tuple[np.ndarray, np.ndarray]:
        tokens = np.empty(self.row_len, dtype=np.int64)
        starts = np.zeros(self.row_len, dtype=bool)
        filled, empty_run = 0, 0
        self._row_docs = []
        while filled < self.row_len:
            if self._doc is None:
                self._doc = self._load_doc()
            if self.offset >= len(self._doc):  # an empty document (no text, no eos)
                empty_run += 1
                if empty_run > len(self._docs()):
                    raise DataError(f"corpus {self.corpus.description} yields no tokens")
                self._advance_doc()
                continue
            empty_run = 0
            self._row_docs.append(int(self._docs()[self.cursor]))
            take = min(len(self._doc) - self.offset, self.row_len - filled)
            tokens[filled : filled + take] = self._doc[self.offset : self.offset + take]
            starts[filled] = self.offset == 0
            filled += take
            self.offset += take
            if self.offset == len(self._doc):
                self._advance_doc()
        return tokens, starts

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor, "offset": self.offset, "num_docs": len(self.corpus),
                "row_len": self.row_len, "world_size": self.world, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_same(state, {"num_docs": len(self.corpus), "row_len": self.row_len, "world_size": self.world,
                            "seed": self.seed}, self.corpus.description)
        self.epoch, self.cursor, self.offset = int(state["epoch"]), int(state["cursor"]), int(state["offset"])
        self._doc = None


class _BinStream:
    """This rank's rows from pre-tokenized token files: file f contributes len_f // row_len whole rows (rows never
    span files), global row g goes to rank g % world. Position = (epoch, index into this rank's rows).
    With vocab_size, every token id is checked to be below it up front (one memory-mapped pass per file)."""

    def __init__(self, files: list[str], *, dtype: str, eos_id: int, row_len: int, rank: int, world: int,
                 vocab_size: int | None = None) -> None:
        self.files, self.eos_id, self.row_len, self.rank, self.world = files, eos_id, row_len, rank, world
        self.description = ", ".join(files)
        itemsize = np.dtype(dtype).itemsize
        self._arrays = []
        for path in files:
            size = os.path.getsize(path)
            if size % itemsize:
                raise DataError(f"token file {path}: size {size} is not a multiple of data.bin_dtype={dtype} "
                                f"({itemsize} bytes)")
            self._arrays.append(np.memmap(path, dtype=dtype, mode="r") if size else np.empty(0, dtype=dtype))
            if vocab_size is not None:
                _check_token_ids(path, self._arrays[-1], vocab_size, dtype)
        rows = np.asarray([len(a) // row_len for a in self._arrays], dtype=np.int64)
        self._first_row = np.concatenate([[0], np.cumsum(rows)])
        self.num_rows = int(self._first_row[-1])
        self.rows_per_rank = self.num_rows // world
        if self.rows_per_rank == 0:
            raise DataError(f"token file(s) {self.description} hold {self.num_rows} rows of {row_len} tokens; "
                             f"need at least {world} (one per data-parallel rank)")
        self.epoch, self.index = 0, 0
        self._row: tuple[int, int] = (0, 0)

    def row_documents(self) -> list[str]:
        """Where the last row came from: file, row index and token range."""
        f, local = self._row
        return [f"{self.files[f]} row {local} (tokens {local * self.row_len}..{(local + 1) * self.row_len - 1})"]

    def next_row(self) -> tuple[np.ndarray, np.ndarray]:
        g = self.index * self.world + self.rank
        f = int(np.searchsorted(self._first_row, g, side="right")) - 1
        local = g - int(self._first_row[f])
        self._row = (f, local)
        tokens = np.asarray(self._arrays[f][local * self.row_len : (local + 1) * self.row_len], dtype=np.int64)
        starts = np.empty(self.row_len, dtype=bool)
        starts[0] = True
        starts[1:] = tokens[:-1] == self.eos_id
        self.index += 1
        if self.index == self.rows_per_rank:
            self.epoch, self.index = self.epoch + 1, 0
        return tokens, starts

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "num_rows": self.num_rows, "row_len": self.row_len,
                "world_size": self.world}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_same(state, {"num_rows": self.num_rows, "row_len": self.row_len, "world_size": self.world},
                    self.description)
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def _check_token_ids(path: str, tokens: np.ndarray, vocab_size: int, dtype: str) -> None:
    """DataError naming the first token id >= vocab_size in `tokens` (a memory-mapped file), read in chunks."""
    step = max(1, _CHUNK_BYTES // tokens.itemsize)
    for start in range(0, len(tokens), step):
        chunk = tokens[start : start + step]
        if int(chunk.max()) >= vocab_size:
            pos = start + int(np.argmax(chunk >= vocab_size))
            raise DataError(f"token file {path} holds token id {int(tokens[pos])} at position {pos}, but the model's "
                            f"vocab_size is {vocab_size}: was it tokenized with another tokenizer, or is "
                            f"data.bin_dtype ({dtype}) wrong?")


def _check_same(state: dict[str, Any], expected: dict[str, int], description: str) -> None:
    for key, value in expected.items():
        if key not in state or int(state[key]) != value:
            raise DataError(f"dataloader state does not match this run's data ({description}): {key} was "
                             f"{state.get(key)!r}, is {value}; exact resume needs the same data, seq_len, "
                             "seed and data-parallel size")


# ---------------------------------------------------------------------------------------------- batching
def pack_batch(tokens: np.ndarray, starts: np.ndarray) -> dict[str, torch.Tensor]:
    """Rows [B, T+1] of tokens and doc-start flags -> the training batch.

    input_ids, labels: LongTensor [B, T] (labels -100 where the next token starts a new document);
    doc_ids: LongTensor [B, T], document index within the row (0 at each row start, +1 at each new document);
    cu_seqlens: IntTensor [n_docs + 1], document boundaries of the flattened [1, B*T] view (every row start is one).
    """
    b, t = tokens.shape[0], tokens.shape[1] - 1
    labels = tokens[:, 1:].copy()
    labels[starts[:, 1:]] = IGNORE_INDEX
    begins = starts[:, :t].copy()
    begins[:, 0] = True
    doc_ids = np.cumsum(begins, axis=1) - 1
    cu = np.concatenate([np.flatnonzero(begins.reshape(-1)), [b * t]]).astype(np.int32)
    return {
        "input_ids": torch.from_numpy(np.ascontiguousarray(tokens[:, :-1])),
        "labels": torch.from_numpy(labels),
        "doc_ids": torch.from_numpy(doc_ids.astype(np.int64)),
        "cu_seqlens": torch.from_numpy(cu),
    }


class PackedDataLoader:
    """Infinite iterator of packed batches for one data-parallel rank; Stateful (state_dict/load_state_dict).

    The state is keyed by `dp_rank_{rank}` so a DCP checkpoint holds every rank's position without collisions.
    """

    def __init__(self, stream: _DocStream | _BinStream, *, local_batch_size: int, dp_rank: int) -> None:
        self.stream, self.local_batch_size, self.dp_rank = stream, local_batch_size, dp_rank
        self._key = f"dp_rank_{dp_rank}"
        self.last_documents: list[str] = []  # where the last batch came from (named when its loss is not finite)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        rows, docs = [], []
        for _ in range(self.local_batch_size):
            rows.append(self.stream.next_row())
            docs += self.stream.row_documents()
        self.last_documents = list(dict.fromkeys(docs))
        return pack_batch(np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows]))

    def state_dict(self) -> dict[str, Any]:
        return {self._key: self.stream.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._key not in state_dict:
            raise DataError(f"dataloader state has no entry {self._key!r} (keys: {sorted(state_dict)}); "
                             "was it saved with a different data-parallel size?")
        self.stream.load_state_dict(state_dict[self._key])


def build_dataloader(*, cfg: DataConfig, tokenizer: Any, seq_len: int, local_batch_size: int, dp_rank: int,
                     dp_world_size: int, seed: int, vocab_size: int | None = None) -> PackedDataLoader:
    """The packed loader for `cfg.source`, sharded for (dp_rank, dp_world_size) and shuffled by `seed`; the data
    is checked here (module docstring), `.bin` token ids against `vocab_size` when given."""
    if seq_len < 1 or local_batch_size < 1:
        raise ValueError(f"seq_len ({seq_len}) and local_batch_size ({local_batch_size}) must be >= 1")
    if not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_world_size={dp_world_size})")
    row_len = seq_len + 1
    shard = dict(row_len=row_len, rank=dp_rank, world=dp_world_size)
    if cfg.source == "bin":
        stream: _DocStream | _BinStream = _BinStream(_expand(cfg.paths, ".bin"), dtype=cfg.bin_dtype,
                                                     eos_id=tokenizer.eos_id, vocab_size=vocab_size, **shard)
    else:
        if cfg.source == "builtin":
            files = builtin_corpus_files()
            corpus: Any = _FileCorpus(files, f"builtin (standard library at {sysconfig.get_paths()['stdlib']})")
        elif cfg.source == "txt":
            files = _check_text_files(_expand(cfg.paths, ".txt"), cfg.errors, log=dp_rank == 0)
            corpus = _FileCorpus(files, ", ".join(cfg.paths), errors="replace" if cfg.errors == "replace" else "strict")
        elif cfg.source == "jsonl":
            corpus = _JsonlCorpus(_expand(cfg.paths, ".jsonl"), cfg.text_key)
        else:
            raise ValueError(f"unknown data.source {cfg.source!r}")
        if len(corpus) == 0:
            raise DataError(f"corpus {corpus.description} is empty (no documents)")
        stream = _DocStream(corpus, tokenizer, add_eos=cfg.add_eos, seed=seed, **shard)
    return PackedDataLoader(stream, local_batch_size=local_batch_size, dp_rank=dp_rank)
