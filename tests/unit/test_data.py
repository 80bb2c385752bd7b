"""data.py: packing with document boundaries, label masking, sharding, determinism, exact resume, sources, errors."""

import copy
import json
import pickle
import re

import numpy as np
import pytest
import torch

from torchtitan_glm.components.data import build_dataloader, builtin_corpus_files
from torchtitan_glm.components.errors import DataError, ResumeMismatchError
from torchtitan_glm.components.tokenizer import ByteTokenizer
from torchtitan_glm.config import DataConfig

TOK = ByteTokenizer()
EOS = TOK.eos_id


def make_loader(cfg, *, seq_len=32, batch=4, rank=0, world=1, seed=0, tok=TOK, vocab_size=None):
    return build_dataloader(cfg=cfg, tokenizer=tok, seq_len=seq_len, local_batch_size=batch, dp_rank=rank,
                            dp_world_size=world, seed=seed, vocab_size=vocab_size)


def take(loader, n):
    return [next(loader) for _ in range(n)]


def write_jsonl(path, texts, key="text"):
    path.write_text("".join(json.dumps({key: t}) + "\n" for t in texts))
    return str(path)


def numbered_docs(n=40):
    # Distinct, short documents of varied length, each tagged with its number so rows can be traced to documents.
    return [f"<{i:03d}>" + "x" * (i % 7) + f"</{i:03d}>" for i in range(n)]


def check_structure(batch, *, eos_marks_boundaries=True):
    """doc_ids, cu_seqlens and labels agree with each other (and with eos positions when eos separates docs)."""
    x, y, doc, cu = batch["input_ids"], batch["labels"], batch["doc_ids"], batch["cu_seqlens"]
    b, t = x.shape
    assert x.dtype == y.dtype == doc.dtype == torch.int64 and cu.dtype == torch.int32
    assert y.shape == doc.shape == (b, t)
    assert (doc[:, 0] == 0).all()
    step = doc[:, 1:] - doc[:, :-1]
    assert ((step == 0) | (step == 1)).all()  # increasing by one at each new document
    new_doc = torch.zeros(b, t, dtype=torch.bool)
    new_doc[:, 0] = True
    new_doc[:, 1:] = step == 1
    expected_cu = torch.cat([new_doc.reshape(-1).nonzero().flatten(), torch.tensor([b * t])])
    assert torch.equal(cu.long(), expected_cu)
    assert cu[0] == 0 and cu[-1] == b * t and (cu[1:] > cu[:-1]).all()
    # labels: the next input token, except -100 where the next token starts a new document
    inner_masked = y[:, :-1] == -100
    assert torch.equal(inner_masked, new_doc[:, 1:])
    keep = ~inner_masked
    assert torch.equal(y[:, :-1][keep], x[:, 1:][keep])
    if eos_marks_boundaries:
        assert torch.equal(new_doc[:, 1:], x[:, :-1] == EOS)
        assert torch.equal(y == -100, x == EOS)  # eos tokens never predict the next document
    return new_doc


# ------------------------------------------------------------------------------------------------ builtin
def test_builtin_corpus_is_stdlib_and_sorted():
    files = builtin_corpus_files()
    assert len(files) > 100 and files == sorted(files)
    assert all(f.endswith(".py") and "site-packages" not in f for f in files)
    assert any(f.endswith("/json/__init__.py") for f in files)


def test_builtin_batches_shape_structure_determinism():
    a = take(make_loader(DataConfig(), seq_len=64, batch=4, seed=1), 6)
    b = take(make_loader(DataConfig(), seq_len=64, batch=4, seed=1), 6)
    c = take(make_loader(DataConfig(), seq_len=64, batch=4, seed=2), 6)
    for x, y in zip(a, b):
        assert x.keys() == {"input_ids", "labels", "doc_ids", "cu_seqlens"}
        assert x["input_ids"].shape == (4, 64)
        check_structure(x)
        for k in x:
            assert torch.equal(x[k], y[k])
    assert not all(torch.equal(x["input_ids"], z["input_ids"]) for x, z in zip(a, c))  # the seed shuffles docs
    text = TOK.decode(a[0]["input_ids"][0].tolist())
    assert text.isprintable() or "\n" in text


def test_rows_without_document_masking_are_one_sequence(tmp_path):
    """data.document_masking = false: the same rows, given as one causal sequence each -- no document ids, and every
    label the next token of the row, across document ends too (where the masked batch has -100)."""
    paths = [write_jsonl(tmp_path / "d.jsonl", numbered_docs())]
    masked = take(make_loader(DataConfig(source="jsonl", paths=paths), seq_len=48, batch=3, seed=4), 4)
    plain = take(make_loader(DataConfig(source="jsonl", paths=paths, document_masking=False), seq_len=48, batch=3,
                             seed=4), 4)
    for m, p in zip(masked, plain):
        assert p.keys() == {"input_ids", "labels"}
        assert torch.equal(p["input_ids"], m["input_ids"])
        assert torch.equal(p["labels"][:, :-1], p["input_ids"][:, 1:])
        kept = m["labels"] != -100
        assert torch.equal(p["labels"][kept], m["labels"][kept])
        assert (p["labels"] != -100).all()
    assert any((m["labels"] == -100).any() for m in masked)  # the rows do cross documents


def test_builtin_ranks_get_distinct_rows():
    rows = []
    for rank in range(2):
        batches = take(make_loader(DataConfig(), seq_len=48, batch=4, rank=rank, world=2, seed=3), 5)
        rows.append({tuple(r.tolist()) for bt in batches for r in bt["input_ids"]})
    assert len(rows[0]) == 20 and len(rows[1]) == 20
    assert not rows[0] & rows[1]


def roundtrip_resume(cfg, **kw):
    full = take(make_loader(cfg, **kw), 10)
    first = make_loader(cfg, **kw)
    take(first, 4)
    state = pickle.loads(pickle.dumps(copy.deepcopy(first.state_dict())))
    resumed = make_loader(cfg, **kw)
    resumed.load_state_dict(state)
    rest = take(resumed, 6)
    for x, y in zip(full[4:], rest):
        for k in x:
            assert torch.equal(x[k], y[k]), k


def test_resume_is_exact_builtin():
    roundtrip_resume(DataConfig(), seq_len=40, batch=3, rank=1, world=2, seed=5)


def test_resume_is_exact_jsonl_across_epochs(tmp_path):
    # 40 short docs, 2 ranks: the 10 batches cross several epochs, the state lands mid-document
    cfg = DataConfig(source="jsonl", paths=[write_jsonl(tmp_path / "d.jsonl", numbered_docs())])
    roundtrip_resume(cfg, seq_len=23, batch=3, rank=0, world=2, seed=9)


def test_state_mismatch_is_rejected_naming_the_key(tmp_path):
    cfg = DataConfig(source="jsonl", paths=[write_jsonl(tmp_path / "d.jsonl", numbered_docs())])
    loader = make_loader(cfg, seq_len=16)
    take(loader, 2)
    state = loader.state_dict()
    assert state["position"] == 8 and state["global_batch_rows"] == 4
    with pytest.raises(ResumeMismatchError, match=r"training\.seq_len was 16, is 17"):
        make_loader(cfg, seq_len=17).load_state_dict(state)
    with pytest.raises(ResumeMismatchError, match=r"job\.seed was 0, is 1"):
        make_loader(cfg, seq_len=16, seed=1).load_state_dict(state)
    other = DataConfig(source="jsonl", paths=[write_jsonl(tmp_path / "e.jsonl", numbered_docs(30))])
    with pytest.raises(ResumeMismatchError, match=r"documents was 40, is 30.*data\.paths"):
        make_loader(other, seq_len=16).load_state_dict(state)
    with pytest.raises(DataError, match="older version"):
        make_loader(cfg, seq_len=16).load_state_dict({"dp_rank_0": {"epoch": 0}})
    make_loader(cfg, seq_len=16, rank=1, world=2).load_state_dict(state)  # another layout resumes


def global_batches(cfg, world, steps, *, global_rows=4, state=None, **kw):
    """The global batches (input_ids, labels, doc_ids concatenated over the ranks) of `steps` steps under `world`
    data-parallel ranks, each loader optionally resumed from `state`."""
    loaders = [make_loader(cfg, batch=global_rows // world, rank=r, world=world, **kw) for r in range(world)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    out = []
    for _ in range(steps):
        parts = [next(loader) for loader in loaders]
        out.append({k: torch.cat([p[k] for p in parts]) for k in ("input_ids", "labels", "doc_ids")})
    assert len({str(loader.state_dict()) for loader in loaders}) == 1  # one global state, the same on every rank
    return out, loaders[0].state_dict()


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for k in x:
            assert torch.equal(x[k], y[k]), k


@pytest.mark.parametrize("source", ["jsonl", "bin", "builtin"])
def test_global_batches_do_not_depend_on_the_data_parallel_degree(tmp_path, source):
    if source == "jsonl":  # 40 short documents: 12 steps of 4 rows of 24 tokens cross several epochs
        cfg, kw = DataConfig(source="jsonl", paths=[write_jsonl(tmp_path / "d.jsonl", numbered_docs())]), {}
    elif source == "bin":  # 18 rows: epochs end inside global batches
        write_bin(tmp_path / "a.bin", 11 * 25 + 3, "uint16", seed=1)
        write_bin(tmp_path / "b.bin", 7 * 25, "uint16", seed=2)
        cfg, kw = DataConfig(source="bin", paths=[str(tmp_path / "a.bin"), str(tmp_path / "b.bin")]), {}
    else:
        cfg, kw = DataConfig(), {"seed": 3}
    ref, ref_state = global_batches(cfg, 1, 12, seq_len=24, **kw)
    for world in (2, 4):
        got, state = global_batches(cfg, world, 12, seq_len=24, **kw)
        assert_same_batches(got, ref)
        assert state == ref_state
    for b in ref:
        check_structure(b | {"cu_seqlens": pack_cu(b)}, eos_marks_boundaries=source != "bin")


def pack_cu(batch):
    b, t = batch["doc_ids"].shape
    new = torch.ones(b, t, dtype=torch.bool)
    new[:, 1:] = batch["doc_ids"][:, 1:] != batch["doc_ids"][:, :-1]
    return torch.cat([new.reshape(-1).nonzero().flatten(), torch.tensor([b * t])]).int()


def test_resume_under_another_layout_and_batch_size_reads_the_next_rows(tmp_path):
    cfg = DataConfig(source="jsonl", paths=[write_jsonl(tmp_path / "d.jsonl", numbered_docs())])
    ref, _ = global_batches(cfg, 1, 8, seq_len=20)
    _, state = global_batches(cfg, 2, 3, seq_len=20)  # 3 steps under dp=2
    for world in (1, 4):  # the same global batch under another data-parallel degree: the same next batches
        rest, _ = global_batches(cfg, world, 5, seq_len=20, state=state)
        assert_same_batches(rest, ref[3:])
    # a global batch of 2 rows continues at the same row: its steps are the halves of the 4-row steps
    halves, _ = global_batches(cfg, 2, 4, seq_len=20, state=state, global_rows=2)
    for i, h in enumerate(halves):
        whole = ref[3 + i // 2]
        assert torch.equal(h["input_ids"], whole["input_ids"][(i % 2) * 2:(i % 2) * 2 + 2])


class CountingTokenizer(ByteTokenizer):
    """A tokenizer that is not the byte tokenizer to the loader (so counting calls encode), recording calls."""

    def __init__(self):
        self.calls = []

    def encode(self, text):
        self.calls.append(text[:5])
        return list(text.encode("utf-8"))


def test_a_rank_tokenises_only_the_documents_its_rows_overlap(tmp_path):
    docs = numbered_docs()
    cfg = DataConfig(source="jsonl", paths=[write_jsonl(tmp_path / "d.jsonl", docs)])
    tok = CountingTokenizer()
    loader = make_loader(cfg, seq_len=15, batch=1, rank=3, world=4, tok=tok)
    assert len(tok.calls) == len(docs)  # one count per document, when built (split over ranks under a group)
    tok.calls.clear()
    for _ in range(3):
        tok.calls.clear()
        next(loader)
        overlapped = [docs[int(d.rsplit(":", 1)[1]) - 1][:5] for d in loader.last_documents]
        assert tok.calls and sorted(tok.calls) == sorted(overlapped)  # each once, no other rank's document


# -------------------------------------------------------------------------------------------------- jsonl
def test_jsonl_packing_boundaries_and_labels(tmp_path):
    docs = numbered_docs()
    cfg = DataConfig(source="jsonl", paths=[write_jsonl(tmp_path / "d.jsonl", docs)])
    batches = take(make_loader(cfg, seq_len=24, batch=4), 8)
    n_boundaries = 0
    for bt in batches:
        new_doc = check_structure(bt)
        n_boundaries += int(new_doc[:, 1:].sum())
    assert n_boundaries > 10  # short docs: many boundaries inside rows
    # the packed stream is exactly the documents, each followed by eos, in a fresh permutation each epoch
    # (a row's last token is only a label; when it starts a document that label is -100, hence the optional "<")
    stream = torch.cat([torch.cat([bt["input_ids"], bt["labels"][:, -1:]], 1).reshape(-1) for bt in batches])
    text = TOK.decode(stream.tolist())
    seen = re.findall(r"<?(\d{3})>x*</\1>", text)
    assert len(seen) > 45 and sorted(seen[:40]) == [f"{i:03d}" for i in range(40)]
    assert seen[40:45] != seen[:5]


def test_jsonl_without_eos_still_masks_document_ends(tmp_path):
    docs = ["a" * 5, "b" * 7, "c" * 3, "d" * 9]
    cfg = DataConfig(source="jsonl", paths=[write_jsonl(tmp_path / "d.jsonl", docs)], add_eos=False)
    bt = next(make_loader(cfg, seq_len=12, batch=1, seed=0))
    new_doc = check_structure(bt, eos_marks_boundaries=False)
    x = bt["input_ids"][0]
    assert EOS not in x.tolist()
    # a new document starts exactly where the letter changes
    assert torch.equal(new_doc[0, 1:], x[1:] != x[:-1])


def test_jsonl_epoch_is_every_document_once(tmp_path):
    # 30 docs of 12 tokens (11 bytes + eos) = 360 tokens = 15 rows of 24: one global batch of 3 ranks x 5 is one epoch
    docs = [f"<{i:03d}></{i:03d}>" for i in range(30)]
    cfg = DataConfig(source="jsonl", paths=[write_jsonl(tmp_path / "d.jsonl", docs)])
    seen = []
    for rank in range(3):
        loader = make_loader(cfg, seq_len=23, batch=5, rank=rank, world=3, seed=4)
        bt = next(loader)
        assert loader.state_dict()["position"] == 15
        text = TOK.decode(torch.cat([bt["input_ids"], bt["labels"][:, -1:]], 1).reshape(-1).tolist())
        seen.append(re.findall(r"<(\d{3})>", text))
    assert all(len(s) == len(set(s)) for s in seen)
    assert sorted(seen[0] + seen[1] + seen[2]) == [f"{i:03d}" for i in range(30)]  # disjoint and complete


def test_jsonl_errors_name_file_and_line_when_the_loader_is_built(tmp_path):
    """Every line is parsed up front: the bad line far from the start stops the build, not step N."""
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n' * 50 + '{"text": broken}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:101: invalid JSON"):
        make_loader(DataConfig(source="jsonl", paths=[str(path)]), seq_len=8, batch=1)
    path2 = tmp_path / "nokey.jsonl"
    path2.write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match=r"nokey\.jsonl:1: .*'text'"):
        make_loader(DataConfig(source="jsonl", paths=[str(path2)]), seq_len=8, batch=1)
    assert next(make_loader(DataConfig(source="jsonl", paths=[str(path2)], text_key="body"), seq_len=8, batch=1))
    path3 = tmp_path / "latin1.jsonl"
    path3.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1\.jsonl:2: invalid JSON"):
        make_loader(DataConfig(source="jsonl", paths=[str(path3)]), seq_len=8, batch=1)
    path4 = tmp_path / "num.jsonl"
    path4.write_text('{"text": 3}\n')
    with pytest.raises(DataError, match=r"num\.jsonl:1: 'text' is int"):
        make_loader(DataConfig(source="jsonl", paths=[str(path4)]), seq_len=8, batch=1)


def test_corpus_errors(tmp_path):
    with pytest.raises(DataError, match="file not found: .*missing.jsonl"):
        make_loader(DataConfig(source="jsonl", paths=[str(tmp_path / "missing.jsonl")]))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="empty.jsonl is empty"):
        make_loader(DataConfig(source="jsonl", paths=[str(empty)]))
    blank = write_jsonl(tmp_path / "blank.jsonl", ["", ""])
    with pytest.raises(ValueError, match="blank.jsonl yields no tokens"):
        next(make_loader(DataConfig(source="jsonl", paths=[blank], add_eos=False)))
    one = write_jsonl(tmp_path / "one.jsonl", ["only"])  # one document serves any number of ranks
    assert next(make_loader(DataConfig(source="jsonl", paths=[one]), seq_len=8, batch=1, rank=1, world=2))


def test_txt_files_are_documents(tmp_path):
    (tmp_path / "a.txt").write_text("alpha " * 3)
    (tmp_path / "b.txt").write_text("beta " * 3)
    (tmp_path / "ignored.md").write_text("not text corpus")
    bt = next(make_loader(DataConfig(source="txt", paths=[str(tmp_path)]), seq_len=60, batch=1))
    check_structure(bt)
    text = TOK.decode(bt["input_ids"][0].tolist())
    assert "alpha" in text and "beta" in text and "not text" not in text


def test_txt_that_is_not_utf8_follows_data_errors(tmp_path):
    (tmp_path / "a.txt").write_text("alpha " * 3)
    (tmp_path / "blob.txt").write_bytes("ok ".encode() * 10 + bytes([0xFF, 0x00, 0x9C]) + b"tail")
    paths = [str(tmp_path)]
    with pytest.raises(DataError, match=r"blob\.txt is not valid UTF-8 text \(at byte 30 .*data\.errors"):
        make_loader(DataConfig(source="txt", paths=paths), seq_len=60, batch=1)
    kept = make_loader(DataConfig(source="txt", paths=paths, errors="skip"), seq_len=40, batch=1)
    assert kept.stream.corpus.files == [str(tmp_path / "a.txt")]
    replaced = make_loader(DataConfig(source="txt", paths=paths, errors="replace"), seq_len=200, batch=1)
    text = TOK.decode(next(replaced)["input_ids"][0].tolist())
    assert "\ufffd" in text and "alpha" in text


def test_batches_name_their_documents(tmp_path):
    docs = numbered_docs(12)
    path = write_jsonl(tmp_path / "d.jsonl", docs)
    loader = make_loader(DataConfig(source="jsonl", paths=[path]), seq_len=16, batch=2)
    batch = next(loader)
    text = TOK.decode(batch["input_ids"].reshape(-1).tolist())
    lines = [int(d.rsplit(":", 1)[1]) for d in loader.last_documents]
    assert all(d.startswith(path + ":") for d in loader.last_documents)
    for n in re.findall(r"<(\d{3})>", text):  # every document whose start is in the batch is named
        assert int(n) + 1 in lines


# ---------------------------------------------------------------------------------------------------- bin
def write_bin(path, n_tokens, dtype, seed=0):
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, 256, size=n_tokens)
    toks[rng.random(n_tokens) < 0.08] = EOS  # documents of ~12 tokens
    toks.astype(dtype).tofile(path)
    return toks


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_rows_are_file_slices(tmp_path, dtype):
    s = 16
    toks = write_bin(tmp_path / "t.bin", 40 * (s + 1) + 5, dtype)
    cfg = DataConfig(source="bin", paths=[str(tmp_path / "t.bin")], bin_dtype=dtype)
    for rank in range(2):
        batches = take(make_loader(cfg, seq_len=s, batch=2, rank=rank, world=2), 3)
        for i, bt in enumerate(batches):
            check_structure(bt)
            for j in range(2):
                g = i * 4 + rank * 2 + j  # each rank reads its contiguous slice of the 4-row global batch
                row = toks[g * (s + 1):(g + 1) * (s + 1)]
                assert bt["input_ids"][j].tolist() == row[:-1].tolist()
                expect = np.where(row[:-1] == EOS, -100, row[1:])
                assert bt["labels"][j].tolist() == expect.tolist()


def test_bin_resume_and_epoch_wrap(tmp_path):
    s = 8
    write_bin(tmp_path / "a.bin", 7 * (s + 1) + 3, "uint16", seed=1)
    write_bin(tmp_path / "b.bin", 5 * (s + 1), "uint16", seed=2)
    cfg = DataConfig(source="bin", paths=[str(tmp_path / "a.bin"), str(tmp_path / "b.bin")])
    roundtrip_resume(cfg, seq_len=s, batch=2, rank=1, world=2)  # 12 rows, 6 per rank: 10 batches = 3+ epochs
    loader = make_loader(cfg, seq_len=s, batch=6, rank=0, world=2)
    first, second = next(loader), next(loader)
    assert torch.equal(first["input_ids"], second["input_ids"])  # one batch = one epoch: it repeats


def test_bin_token_ids_are_checked_against_the_vocab(tmp_path):
    toks = write_bin(tmp_path / "t.bin", 5000, "uint16")
    cfg = DataConfig(source="bin", paths=[str(tmp_path / "t.bin")])
    make_loader(cfg, seq_len=16, vocab_size=258)  # max id is eos = 257
    toks[4321] = 300
    toks.astype("uint16").tofile(tmp_path / "t.bin")
    with pytest.raises(DataError, match=r"t\.bin holds token id 300 at position 4321, but the model's vocab_size "
                                        r"is 258.*data\.bin_dtype \(uint16\)"):
        make_loader(cfg, seq_len=16, vocab_size=258)
    loader = make_loader(cfg, seq_len=16, batch=1)  # no vocab given: no check
    next(loader)
    assert loader.last_documents == [f"{tmp_path / 't.bin'} row 0 (tokens 0..16)"]


def test_bin_errors_name_file(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 5)
    with pytest.raises(ValueError, match="odd.bin"):
        make_loader(DataConfig(source="bin", paths=[str(tmp_path / "odd.bin")], bin_dtype="uint16"))
    write_bin(tmp_path / "small.bin", 10, "uint16")
    with pytest.raises(ValueError, match="small.bin"):
        make_loader(DataConfig(source="bin", paths=[str(tmp_path / "small.bin")]), seq_len=16)


def test_a_jsonl_file_changed_under_a_running_job_is_named_as_changed(tmp_path):
    from torchtitan_glm.components.data import _JsonlCorpus

    path = write_jsonl(tmp_path / "d.jsonl", ["first document", "second document", "third document"])
    corpus = _JsonlCorpus([path], "text")
    assert corpus.read(2) == "third document"
    with open(path, "w") as f:  # rewritten shorter: the indexed offsets now land inside other lines
        f.write(json.dumps({"text": "a much longer first document than before"}) + "\n")
    with pytest.raises(DataError, match="changed since the run started"):
        corpus.read(1)
    # a bad line in an unchanged file is still reported as a bad line
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n')
    corpus = _JsonlCorpus([str(bad)], "text")
    corpus._offset[0] = 3  # reads from inside the line, as a stale index would
    with pytest.raises(DataError, match="invalid JSON"):
        corpus.read(0)


def test_a_changed_bin_file_does_not_resume_silently(tmp_path):
    """The identity of .bin data names each file with its size and a fingerprint of its start and end: other
    tokens of the same size refuse the resume naming the file; unchanged data, and an identity saved before the
    per-file fields existed, resume."""
    s = 8
    path = tmp_path / "r.bin"
    write_bin(path, 30 * (s + 1), "uint16", seed=1)
    cfg = DataConfig(source="bin", paths=[str(path)])
    loader = make_loader(cfg, seq_len=s, batch=2)
    take(loader, 2)
    state = pickle.loads(pickle.dumps(loader.state_dict()))
    make_loader(cfg, seq_len=s, batch=2).load_state_dict(state)  # the same data resumes
    old = {**state, "data": {"rows_per_epoch": state["data"]["rows_per_epoch"]}}  # saved before "files" existed
    make_loader(cfg, seq_len=s, batch=2).load_state_dict(old)
    write_bin(path, 30 * (s + 1), "uint16", seed=2)  # other tokens, same size
    with pytest.raises(ResumeMismatchError, match=r"file r\.bin has other content"):
        make_loader(cfg, seq_len=s, batch=2).load_state_dict(state)
    write_bin(path, 31 * (s + 1), "uint16", seed=1)
    with pytest.raises(ResumeMismatchError, match=r"file r\.bin was 540 bytes, is 558; rows_per_epoch was 30, is 31"):
        make_loader(cfg, seq_len=s, batch=2).load_state_dict(state)


def test_bin_fingerprint_reads_only_the_ends_of_a_large_file(tmp_path):
    from torchtitan_glm.components import data

    big = tmp_path / "big.bin"
    mib = 1 << 20
    raw = bytearray(np.random.default_rng(0).integers(0, 256, 3 * mib, dtype=np.uint8).tobytes())
    big.write_bytes(bytes(raw))
    before = data._fingerprint(str(big))
    raw[mib + 5] ^= 1  # in the unhashed middle
    big.write_bytes(bytes(raw))
    assert data._fingerprint(str(big)) == before
    for where in (5, 3 * mib - 5):  # in the first or the last MiB
        raw[where] ^= 1
        big.write_bytes(bytes(raw))
        assert data._fingerprint(str(big)) != before
        raw[where] ^= 1


def test_text_identity_against_a_bin_checkpoint_is_still_refused(tmp_path):
    """Only the keys added later may be missing: a checkpoint of another source (no common key) is refused."""
    from torchtitan_glm.components.data import _identity_diff

    assert _identity_diff({"rows_per_epoch": 3}, {"rows_per_epoch": 3, "files": []}) == []
    assert _identity_diff({"rows_per_epoch": 3}, {"documents": 4, "tokens_per_epoch": 9})


def test_a_text_key_the_data_lacks_is_a_setting_error(tmp_path):
    """data.text_key missing from the first document: the setting is wrong, exit 2; missing from a later line
    after documents that had it: the data is wrong, exit 1."""
    from torchtitan_glm.components.errors import EXIT_ERROR, EXIT_USAGE

    path = write_jsonl(tmp_path / "d.jsonl", ["a", "b"], key="content")
    with pytest.raises(DataError, match=r"d\.jsonl:1: expected a JSON object with key 'text' \(data\.text_key\)") as e:
        make_loader(DataConfig(source="jsonl", paths=[path]), seq_len=8, batch=1)
    assert e.value.exit_code == EXIT_USAGE
    later = tmp_path / "later.jsonl"
    later.write_text('{"text": "ok"}\n{"content": "x"}\n')
    with pytest.raises(DataError, match=r"later\.jsonl:2: .*'text'") as e:
        make_loader(DataConfig(source="jsonl", paths=[str(later)]), seq_len=8, batch=1)
    assert e.value.exit_code == EXIT_ERROR


def test_skip_that_leaves_out_every_file_says_so(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"ok" + bytes([0xFF]))
    (tmp_path / "b.txt").write_bytes(bytes([0xC3]))
    with pytest.raises(DataError, match=r"is empty \(no documents\): data\.errors='skip' left out all 2 txt "
                                        r"file\(s\) as not valid UTF-8 text, the first, .*a\.txt, at byte 2"):
        make_loader(DataConfig(source="txt", paths=[str(tmp_path)], errors="skip"), seq_len=8, batch=1)


def test_a_glob_in_data_paths_is_named_as_not_expanded_and_a_directory_is_read_recursively(tmp_path):
    from torchtitan_glm.components.errors import EXIT_USAGE

    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    top = write_jsonl(tmp_path / "a.jsonl", ["top"])
    deep = write_jsonl(tmp_path / "sub" / "deeper" / "b.jsonl", ["deep"])
    with pytest.raises(DataError, match=r"file not found: .*/\*\.jsonl \(glob patterns are not expanded: give the "
                                        r"directory instead") as e:
        make_loader(DataConfig(source="jsonl", paths=[str(tmp_path / "*.jsonl")]), seq_len=8, batch=1)
    assert e.value.exit_code == EXIT_USAGE
    loader = make_loader(DataConfig(source="jsonl", paths=[str(tmp_path)]), seq_len=8, batch=1)
    assert loader.stream.corpus.files == [top, deep]  # the directory's files, nested ones included
    with pytest.raises(DataError, match=r"file not found: .*missing\.jsonl$"):  # no hint without glob characters
        make_loader(DataConfig(source="jsonl", paths=[str(tmp_path / "missing.jsonl")]), seq_len=8, batch=1)
