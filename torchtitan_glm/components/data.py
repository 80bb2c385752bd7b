"""Packed, document-aware, resumable data loading.

Documents come from the running Python's standard-library sources (`builtin`: always present, no download), from
jsonl/txt files, or from a pre-tokenized `.bin` token file (documents separated by eos). Token streams are packed
into rows of seq_len + 1 tokens (inputs row[:-1], labels row[1:]); each batch carries the document structure
(`doc_ids`, `cu_seqlens`) so attention and the KDA state restart at document starts, and the label that would
predict the next document's first token is -100. With `data.document_masking = false` a row is one causal
sequence instead (no document structure in the batch; every label is the next token).

Layout-independent order: the data is one global sequence of rows, a function of (data, seed, seq_len) only --
text documents in a seeded per-epoch permutation packed back to back into one token stream, `.bin` rows in file
order -- and step s's global batch is rows [s*G, (s+1)*G), G = local_batch_size x data-parallel degree, each
data-parallel rank taking its contiguous slice (tensor- and context-parallel ranks of one data-parallel rank get the
same rows). Runs under different layouts with the same G therefore see the same batches, and the resumable state is
one global position (rows consumed), so a run may resume under another layout. Finding row k of a text stream needs
the token count of every earlier document: those counts are computed once when the loader is built, the documents
split over the ranks (one all-gather), and during training a rank tokenises only the documents its own rows
overlap. (Dealing documents to ranks instead would make the order depend on the data-parallel degree; counting on
every rank at every step would tokenise the whole global batch on each of them.) The loader is infinite.

Inputs are checked when the loader is built, before any training: every jsonl line is parsed, txt files are
checked to be UTF-8 (data.errors), and `.bin` token ids are checked against the model's vocab_size (one
memory-mapped pass). Every problem raises DataError naming the file (and line or position).
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import json
import logging
import os
import sysconfig
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist

from torchtitan_glm.components.errors import DataError, ResumeMismatchError
from torchtitan_glm.components.tokenizer import ByteTokenizer
from torchtitan_glm.config import DataConfig

__all__ = ["PackedDataLoader", "build_dataloader", "builtin_corpus_files", "glob_hint"]

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_CHUNK_BYTES = 16 << 20  # read size of the up-front checks
_FINGERPRINT_BYTES = 1 << 20  # a token file's fingerprint hashes this much of its start and of its end
# Identity keys added after checkpoints were first written: a checkpoint whose identity lacks one still resumes.
_ADDED_IDENTITY_KEYS = frozenset({"files"})


# ------------------------------------------------------------------------------------------------ documents
def builtin_corpus_files() -> list[str]:
    """Sorted .py files of this Python's standard library (installed third-party packages excluded)."""
    root = sysconfig.get_paths()["stdlib"]
    files: list[str] = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        files += [os.path.join(folder, n) for n in names if n.endswith(".py")]
    return sorted(files)


def glob_hint(path: str) -> str:
    """For a data.paths entry that does not exist: a note when it holds glob characters (*, ?, [), which nothing
    expands (a directory is read instead, recursively); "" otherwise."""
    if not glob.has_magic(path):
        return ""
    return (" (glob patterns are not expanded: give the directory instead, whose files of the data.source's suffix "
            "are read recursively)")


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
            hint = glob_hint(p)
            raise DataError(f"data.paths: file not found: {p}{hint}", usage=bool(hint))
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
    leaves such files out (with one warning; DataError saying so when that leaves none), "replace" keeps
    everything unchecked."""
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
    kept = [p for p in files if p not in skipped]
    if not kept:
        path, where = bad[0]
        raise DataError(f"corpus {', '.join(files)} is empty (no documents): data.errors='skip' left out all "
                        f"{len(bad)} txt file(s) as not valid UTF-8 text, the first, {path}, at {where}; convert "
                        "them, or set data.errors to 'replace' (decode bad bytes as U+FFFD)")
    return kept


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


def _jsonl_text(raw: bytes, path: str, lineno: int, text_key: str, *, first: bool = False) -> str:
    """The text of one jsonl line; DataError naming `path:lineno` when it is not an object with a string there.
    first: no earlier document was read, so an object without text_key means the setting is wrong (exit 2)."""
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}:{lineno}: invalid JSON: {e}; fix or remove that line") from None
    if not isinstance(obj, dict) or text_key not in obj:
        raise DataError(f"{path}:{lineno}: expected a JSON object with key {text_key!r} (data.text_key)",
                        usage=first and isinstance(obj, dict))
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
                        _jsonl_text(line, path, lineno, text_key, first=not offsets)
                        file_idx.append(fi)
                        offsets.append(pos)
                        lines.append(lineno)
                    pos += len(line)
        self._file = np.asarray(file_idx, dtype=np.int32)
        self._offset = np.asarray(offsets, dtype=np.int64)
        self._line = np.asarray(lines, dtype=np.int64)
        self._stat = [_file_stamp(path) for path in files]  # what the offsets index; a bad read checks it

    def __len__(self) -> int:
        return len(self._offset)

    def name(self, i: int) -> str:
        return f"{self.files[self._file[i]]}:{int(self._line[i])}"

    def read(self, i: int) -> str:
        path, lineno = self.files[self._file[i]], int(self._line[i])
        with open(path, "rb") as f:
            f.seek(int(self._offset[i]))
            raw = f.readline()
        try:
            return _jsonl_text(raw, path, lineno, self.text_key)
        except DataError:
            now = _file_stamp(path)
            if now != self._stat[self._file[i]]:  # the line is fine; the file under the index is not the same
                size, _ = self._stat[self._file[i]]
                raise DataError(f"{path} changed since the run started (indexed at {size} bytes, now {now[0]}): "
                                "documents are read at the byte offsets indexed then; restore the file, or start "
                                "a new run (a resume re-indexes and names what changed)") from None
            raise


def _file_stamp(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


# ------------------------------------------------------------------------------------------- global rows
def _doc_tokens(corpus: Any, tokenizer: Any, i: int, add_eos: bool) -> np.ndarray:
    ids = tokenizer.encode(corpus.read(i))
    if add_eos:
        ids = list(ids) + [tokenizer.eos_id]
    return np.asarray(ids, dtype=np.int64)


def _doc_length(corpus: Any, tokenizer: Any, i: int, add_eos: bool) -> int:
    """Tokens document i contributes; the byte tokenizer's count is the UTF-8 length, no id list built."""
    text = corpus.read(i)
    n = len(text.encode("utf-8")) if type(tokenizer) is ByteTokenizer else len(tokenizer.encode(text))
    return n + int(add_eos)


def _doc_lengths(corpus: Any, tokenizer: Any, add_eos: bool, group: Any) -> np.ndarray:
    """Token count of every document, the work split over the ranks of `group` (every rank gets all counts).

    A rank's read error is shared so that every rank raises the same DataError (none waits on a dead peer)."""
    world = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    rank = dist.get_rank(group) if world > 1 else 0
    mine: Any
    try:
        mine = np.asarray([_doc_length(corpus, tokenizer, i, add_eos) for i in range(rank, len(corpus), world)],
                          dtype=np.int64)
    except DataError as e:
        mine = str(e)
    parts = [mine]
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, mine, group=group)
    for part in parts:
        if isinstance(part, str):
            raise DataError(part)
    lengths = np.empty(len(corpus), dtype=np.int64)
    for r, part in enumerate(parts):
        lengths[r::world] = part
    return lengths


class _TextRows:
    """The global rows of a text corpus: each epoch's documents in a seeded permutation, concatenated into one
    token stream (eos after each document with add_eos) that repeats every epoch; row k is tokens
    [k * row_len, (k + 1) * row_len) of that stream, a function of (corpus, tokenizer, seed, row_len) only.

    The token count of every document is computed once, when the loader is built (split over the ranks), so any
    row is found by a binary search; during training a rank tokenises only the documents its own rows overlap."""

    _KEEP_DOCS = 8  # recently tokenised documents kept (a rank's consecutive rows share documents)

    def __init__(self, corpus: Any, tokenizer: Any, *, add_eos: bool, row_len: int, seed: int,
                 lengths: np.ndarray) -> None:
        self.corpus, self.tokenizer, self.add_eos = corpus, tokenizer, add_eos
        self.row_len, self.seed, self.lengths = row_len, seed, lengths
        self.description = corpus.description
        self.epoch_tokens = int(lengths.sum())
        if self.epoch_tokens == 0:
            raise DataError(f"corpus {corpus.description} yields no tokens")
        self._orders: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # epoch -> (document order, cumulative ends)
        self._docs: dict[int, np.ndarray] = {}

    def identity(self) -> dict[str, int]:
        return {"documents": len(self.corpus), "tokens_per_epoch": self.epoch_tokens}

    def stats(self) -> dict[str, Any]:
        """What one epoch holds (the start-up summary's data row): rows are fractional, the stream wraps mid-row."""
        return {"files": list(self.corpus.files), "documents": len(self.corpus), "tokens": self.epoch_tokens,
                "rows_per_epoch": self.epoch_tokens / self.row_len}

    def _order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        if epoch not in self._orders:
            perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.corpus))
            self._orders = {e: v for e, v in self._orders.items() if e == epoch - 1}  # rows may span two epochs
            self._orders[epoch] = (perm, np.cumsum(self.lengths[perm]))
        return self._orders[epoch]

    def _tokens(self, i: int) -> np.ndarray:
        if i not in self._docs:
            ids = _doc_tokens(self.corpus, self.tokenizer, i, self.add_eos)
            if len(ids) != self.lengths[i]:
                raise DataError(f"document {self.corpus.name(i)} now has {len(ids)} tokens, {int(self.lengths[i])} "
                                "when the run started: did it change during the run?")
            if len(self._docs) >= self._KEEP_DOCS:
                self._docs.pop(next(iter(self._docs)))
            self._docs[i] = ids
        return self._docs[i]

    def row(self, k: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """Row k: its tokens, which positions start a document, and the documents it came from."""
        tokens = np.empty(self.row_len, dtype=np.int64)
        starts = np.zeros(self.row_len, dtype=bool)
        names: list[str] = []
        pos, filled = k * self.row_len, 0
        while filled < self.row_len:
            epoch, offset = divmod(pos, self.epoch_tokens)
            perm, ends = self._order(epoch)
            j = int(np.searchsorted(ends, offset, side="right"))  # empty documents are never picked
            doc = int(perm[j])
            within = offset - (int(ends[j]) - int(self.lengths[doc]))
            take = min(int(self.lengths[doc]) - within, self.row_len - filled)
            tokens[filled:filled + take] = self._tokens(doc)[within:within + take]
            starts[filled] = within == 0
            names.append(self.corpus.name(doc))
            filled += take
            pos += take
        return tokens, starts, names


class _BinRows:
    """The global rows of pre-tokenized token files, in file order: file f contributes len_f // row_len whole rows
    (rows never span files) and row k is row k mod (all rows): no shuffle, pre-tokenized data is assumed shuffled.
    With vocab_size, every token id is checked to be below it up front (one memory-mapped pass per file)."""

    def __init__(self, files: list[str], *, dtype: str, eos_id: int, row_len: int,
                 vocab_size: int | None = None) -> None:
        self.files, self.eos_id, self.row_len = files, eos_id, row_len
        self.description = ", ".join(files)
        itemsize = np.dtype(dtype).itemsize
        self._arrays = []
        self.documents = 0
        for path in files:
            size = os.path.getsize(path)
            if size % itemsize:
                raise DataError(f"token file {path}: size {size} is not a multiple of data.bin_dtype={dtype} "
                                f"({itemsize} bytes)")
            self._arrays.append(np.memmap(path, dtype=dtype, mode="r") if size else np.empty(0, dtype=dtype))
            self.documents += _scan_tokens(path, self._arrays[-1], eos_id=eos_id, vocab_size=vocab_size, dtype=dtype)
        rows = np.asarray([len(a) // row_len for a in self._arrays], dtype=np.int64)
        self._first_row = np.concatenate([[0], np.cumsum(rows)])
        self.num_rows = int(self._first_row[-1])
        self._files_identity = [{"name": os.path.basename(path), "size": os.path.getsize(path),
                                 "sha256": _fingerprint(path)} for path in files]
        if self.num_rows == 0:
            raise DataError(f"token file(s) {self.description} hold no whole row of {row_len} tokens "
                             "(training.seq_len + 1)")

    def identity(self) -> dict[str, Any]:
        """Rows per epoch and, per file, its name, size and content fingerprint (a changed file must not resume)."""
        return {"rows_per_epoch": self.num_rows, "files": [dict(f) for f in self._files_identity]}

    def stats(self) -> dict[str, Any]:
        """What one epoch holds (the start-up summary's data row): tokens in the files, of which the tail of each
        file past its last whole row is never read."""
        return {"files": list(self.files), "documents": self.documents,
                "tokens": int(sum(len(a) for a in self._arrays)), "rows_per_epoch": self.num_rows}

    def row(self, k: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
        g = k % self.num_rows
        f = int(np.searchsorted(self._first_row, g, side="right")) - 1
        local = g - int(self._first_row[f])
        tokens = np.asarray(self._arrays[f][local * self.row_len : (local + 1) * self.row_len], dtype=np.int64)
        starts = np.empty(self.row_len, dtype=bool)
        starts[0] = True
        starts[1:] = tokens[:-1] == self.eos_id
        name = f"{self.files[f]} row {local} (tokens {local * self.row_len}..{(local + 1) * self.row_len - 1})"
        return tokens, starts, [name]


def _fingerprint(path: str) -> str:
    """SHA-256 of a file's size, first MiB and last MiB (the whole file when it is smaller than 2 MiB).

    Not of the whole file: token files are often many GB, and every rank computes this when the loader is built.
    It catches a file rewritten with other tokens of the same size; an edit confined to the middle of a large
    file goes unseen."""
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    try:
        with open(path, "rb") as f:
            if size <= 2 * _FINGERPRINT_BYTES:
                h.update(f.read())
            else:
                h.update(f.read(_FINGERPRINT_BYTES))
                f.seek(size - _FINGERPRINT_BYTES)
                h.update(f.read(_FINGERPRINT_BYTES))
    except OSError as e:
        raise DataError(f"cannot read data file {path}: {e.strerror or e}") from None
    return h.hexdigest()


def _identity_diff(was: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """How the checkpoint's data identity `was` differs from this run's `now`, one phrase per difference (empty: the
    same data). A key of _ADDED_IDENTITY_KEYS that only one side has is not compared: a checkpoint written before
    it existed resumes."""
    keys = sorted(k for k in {**was, **now} if (k in was and k in now) or k not in _ADDED_IDENTITY_KEYS)
    out = []
    for k in keys:
        a, b = was.get(k), now.get(k)
        if a == b:
            continue
        if k == "files" and isinstance(a, list) and isinstance(b, list):
            if len(a) != len(b):
                out.append(f"{len(a)} file(s) were read, now {len(b)}")
            for fa, fb in zip(a, b):
                if fa == fb:
                    continue
                if fa.get("name") != fb.get("name"):
                    out.append(f"file {fa.get('name')} is now {fb.get('name')}")
                elif fa.get("size") != fb.get("size"):
                    out.append(f"file {fb.get('name')} was {fa.get('size')} bytes, is {fb.get('size')}")
                else:
                    out.append(f"file {fb.get('name')} has other content (same size; SHA-256 of its first and "
                               "last MiB differs)")
        else:
            out.append(f"{k} was {a}, is {b}")
    return out


def _scan_tokens(path: str, tokens: np.ndarray, *, eos_id: int, vocab_size: int | None, dtype: str) -> int:
    """The documents of `tokens` (a memory-mapped file, read in chunks): its eos tokens, plus one for text after
    the last. With vocab_size, DataError naming the first token id >= vocab_size."""
    step = max(1, _CHUNK_BYTES // tokens.itemsize)
    documents = int(len(tokens) > 0 and tokens[-1] != eos_id)
    for start in range(0, len(tokens), step):
        chunk = tokens[start : start + step]
        documents += int(np.count_nonzero(chunk == eos_id))
        if vocab_size is not None and int(chunk.max()) >= vocab_size:
            pos = start + int(np.argmax(chunk >= vocab_size))
            raise DataError(f"token file {path} holds token id {int(tokens[pos])} at position {pos}, but the model's "
                            f"vocab_size is {vocab_size}: was it tokenized with another tokenizer, or is "
                            f"data.bin_dtype ({dtype}) wrong?")
    return documents


# ---------------------------------------------------------------------------------------------- batching
def pack_batch(tokens: np.ndarray, starts: np.ndarray, *, document_masking: bool = True) -> dict[str, torch.Tensor]:
    """Rows [B, T+1] of tokens and doc-start flags -> the training batch.

    input_ids, labels: LongTensor [B, T] (labels -100 where the next token starts a new document);
    doc_ids: LongTensor [B, T], document index within the row (0 at each row start, +1 at each new document);
    cu_seqlens: IntTensor [n_docs + 1], document boundaries of the flattened [1, B*T] view (every row start is one).
    document_masking=False: each row is one causal sequence, so the batch is input_ids and labels alone, every label
    the next token (across document ends too).
    """
    b, t = tokens.shape[0], tokens.shape[1] - 1
    labels = tokens[:, 1:].copy()
    if not document_masking:
        return {"input_ids": torch.from_numpy(np.ascontiguousarray(tokens[:, :-1])), "labels": torch.from_numpy(labels)}
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

    Step s's global batch is rows [s * G, (s + 1) * G) of the global row sequence, G = local_batch_size x
    dp_world_size; this rank takes the contiguous slice dp_rank * local_batch_size + [0, local_batch_size). The
    state is one global position (rows consumed), the same on every rank and independent of the layout: a run may
    resume under another data-parallel degree, or another global batch size, and read the same rows next.
    """

    def __init__(self, stream: _TextRows | _BinRows, *, local_batch_size: int, dp_rank: int, dp_world_size: int,
                 seed: int, source: str = "", document_masking: bool = True) -> None:
        self.stream, self.local_batch_size, self.dp_rank = stream, local_batch_size, dp_rank
        self.document_masking = document_masking
        self.source = source  # data.source, named in the start-up summary
        self.global_batch_rows = local_batch_size * dp_world_size
        self.seed = seed
        self.position = 0  # global rows consumed: the next global batch starts at this row
        self.last_documents: list[str] = []  # where the last batch came from (named when its loss is not finite)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        first = self.position + self.dp_rank * self.local_batch_size
        rows = [self.stream.row(k) for k in range(first, first + self.local_batch_size)]
        self.position += self.global_batch_rows
        self.last_documents = list(dict.fromkeys(name for r in rows for name in r[2]))
        return pack_batch(np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows]),
                          document_masking=self.document_masking)

    def summary(self) -> dict[str, Any]:
        """The data this loader reads, for the start-up summary: source (data.source), files, documents, tokens and
        rows_per_epoch (rows of seq_len + 1 tokens in one pass over the data), global_batch_rows and
        document_masking."""
        return {"source": self.source, **self.stream.stats(), "row_len": self.stream.row_len,
                "global_batch_rows": self.global_batch_rows, "document_masking": self.document_masking}

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "global_batch_rows": self.global_batch_rows,
                "row_len": self.stream.row_len, "seed": self.seed, "data": self.stream.identity()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "position" not in state_dict:
            raise DataError(f"dataloader state without a global position (keys: {sorted(state_dict)}): it was saved "
                             "per data-parallel rank by an older version, whose order cannot be continued; resume "
                             "with that version or start fresh with a new --job.dump_folder")
        where = self.stream.description
        if state_dict["row_len"] != self.stream.row_len:
            raise ResumeMismatchError(
                f"cannot continue the data of the checkpoint: training.seq_len was {state_dict['row_len'] - 1}, is "
                f"{self.stream.row_len - 1} (rows are seq_len + 1 tokens); set it back")
        if state_dict["seed"] != self.seed:
            raise ResumeMismatchError(f"cannot continue the data of the checkpoint: job.seed was {state_dict['seed']}, "
                                      f"is {self.seed} (it orders the documents); set it back")
        diff = _identity_diff(state_dict["data"], self.stream.identity())
        if diff:
            raise ResumeMismatchError(
                f"cannot continue the data of the checkpoint: the data ({where}) differs from the checkpoint's "
                f"({'; '.join(diff)}); set data.source / data.paths / data.tokenizer / data.add_eos back or restore "
                "the file(s), or start fresh with a new --job.dump_folder")
        self.position = int(state_dict["position"])


def build_dataloader(*, cfg: DataConfig, tokenizer: Any, seq_len: int, local_batch_size: int, dp_rank: int,
                     dp_world_size: int, seed: int, vocab_size: int | None = None,
                     group: Any = None) -> PackedDataLoader:
    """The packed loader for `cfg.source`: this data-parallel rank's slice of each global batch, documents ordered
    by `seed`; the data is checked here (module docstring), `.bin` token ids against `vocab_size` when given. The
    ranks of `group` (a process group, e.g. the world) share the one-off counting of document tokens."""
    if seq_len < 1 or local_batch_size < 1:
        raise ValueError(f"seq_len ({seq_len}) and local_batch_size ({local_batch_size}) must be >= 1")
    if not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_world_size={dp_world_size})")
    row_len = seq_len + 1
    if cfg.source == "bin":
        stream: _TextRows | _BinRows = _BinRows(_expand(cfg.paths, ".bin"), dtype=cfg.bin_dtype, row_len=row_len,
                                                eos_id=tokenizer.eos_id, vocab_size=vocab_size)
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
        stream = _TextRows(corpus, tokenizer, add_eos=cfg.add_eos, row_len=row_len, seed=seed,
                           lengths=_doc_lengths(corpus, tokenizer, cfg.add_eos, group))
    return PackedDataLoader(stream, local_batch_size=local_batch_size, dp_rank=dp_rank, dp_world_size=dp_world_size,
                            seed=seed, source=cfg.source, document_masking=cfg.document_masking)
