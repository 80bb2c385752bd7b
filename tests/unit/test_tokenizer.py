"""tokenizer.py: byte tokenizer and the tokenizer.json wrapper."""

import json

import pytest

from torchtitan_glm.components.errors import TokenizerError
from torchtitan_glm.components.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer, check_vocab_fits
from torchtitan_glm.config import DataConfig
from torchtitan_glm.models.glm5.args import get_flavor

TEXT = "def f(x):\n    return x + 1  # ünïcödé ✓ 🚀\n"


def test_byte_tokenizer_round_trip_and_specials():
    tok = build_tokenizer(cfg=DataConfig())
    assert isinstance(tok, ByteTokenizer)
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == TEXT
    specials = {tok.bos_id, tok.eos_id, tok.pad_id}
    assert specials == {256, 257, 258} and tok.vocab_size == 259
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == TEXT  # specials are dropped
    assert tok.vocab_size <= get_flavor("debug").vocab_size
    assert tok.decode(ids[:-3] + [0xF0]).endswith("\ufffd")  # a cut multi-byte char does not raise


def _train_tiny_tokenizer(path, specials=("<|endoftext|>", "<pad>")):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT * 3, "hello world, hello tokenizer"], trainer=trainer)
    tok.save(str(path))
    return tok


def test_hf_tokenizer_round_trip(tmp_path):
    raw = _train_tiny_tokenizer(tmp_path / "tokenizer.json")
    for where in (tmp_path / "tokenizer.json", tmp_path):  # a file or the directory holding it
        tok = build_tokenizer(cfg=DataConfig(tokenizer=str(where)))
        assert isinstance(tok, HFTokenizer)
        ids = tok.encode(TEXT)
        assert ids and raw.token_to_id("<|endoftext|>") not in ids  # no specials added on encode
        assert tok.decode(ids) == TEXT
        assert tok.eos_id == raw.token_to_id("<|endoftext|>")
        assert tok.pad_id == raw.token_to_id("<pad>")
        assert tok.bos_id is None
        assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)
        assert tok.decode(ids + [tok.eos_id]) == TEXT


def test_hf_tokenizer_config_declares_specials(tmp_path):
    raw = _train_tiny_tokenizer(tmp_path / "tokenizer.json", specials=("<|endoftext|>", "<|user|>"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|user|>"},
                                                                "bos_token": "<|endoftext|>"}))
    tok = HFTokenizer(str(tmp_path))
    assert tok.eos_id == raw.token_to_id("<|user|>")
    assert tok.bos_id == raw.token_to_id("<|endoftext|>")


def test_hf_tokenizer_errors(tmp_path):
    with pytest.raises(TokenizerError, match="nope.json"):
        HFTokenizer(str(tmp_path / "nope.json"))
    _train_tiny_tokenizer(tmp_path / "tokenizer.json", specials=("<unk>",))
    with pytest.raises(TokenizerError, match="no eos token"):
        HFTokenizer(str(tmp_path / "tokenizer.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="bad.json"):
        HFTokenizer(str(tmp_path / "bad.json"))


def test_vocab_fit_is_checked_naming_both_sizes():
    check_vocab_fits(ByteTokenizer(), vocab_size=259, model="model.flavor 'debug'")
    with pytest.raises(TokenizerError, match=r"has 259 tokens but the model \(model.flavor 'x'\) has vocab_size 258"):
        check_vocab_fits(ByteTokenizer(), vocab_size=258, model="model.flavor 'x'")


# ----------------------------------------------------------------------------------- the tokenizer of an HF export
EXPORT_TEXTS = [TEXT, "", " ", "\n\n\t", "a" * 1000, "日本語のテキスト",
                "e\u0301 (combining) \u00a0nbsp \x00\x7f",
                "<eos> <|endoftext|> literal names of other tokenizers' specials"]


def _write(folder, files):
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def test_byte_tokenizer_export_gives_the_same_ids(tmp_path):
    """The byte tokenizer's tokenizer.json: the same ids and specials through `tokenizers` (our HFTokenizer) and
    through transformers' AutoTokenizer, for ASCII, multi-byte UTF-8, control characters and random code points."""
    import random

    from transformers import AutoTokenizer

    byte = ByteTokenizer()
    folder = _write(tmp_path / "export", byte.hf_files())
    rng = random.Random(0)
    texts = EXPORT_TEXTS + ["".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0xD800),
                                                     rng.randrange(0x10000, 0x110000)])) for _ in range(200))
                            for _ in range(20)]
    hf, auto = HFTokenizer(str(folder)), AutoTokenizer.from_pretrained(str(folder))
    for text in texts:
        ids = byte.encode(text)
        assert hf.encode(text) == ids and auto(text, add_special_tokens=False)["input_ids"] == ids, repr(text[:40])
        assert hf.decode(ids) == text and auto.decode(ids) == text
    assert (hf.vocab_size, hf.bos_id, hf.eos_id, hf.pad_id) == (259, 256, 257, 258)
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (256, 257, 258) and len(auto) == 259
    assert hf.decode([256, *byte.encode("hi"), 257, 258]) == "hi"  # specials dropped, as the byte tokenizer does
    # Ids that are not valid UTF-8 (a sampled token, a row cut mid-character) decode as the byte tokenizer does:
    # only the bad bytes become U+FFFD (a byte-fallback decoder turned the whole run into U+FFFD).
    assert auto.decode([*byte.encode("import os"), 140]) == "import os\ufffd"
    for _ in range(500):
        ids = [rng.randrange(259) for _ in range(rng.randrange(1, 16))]
        assert (hf.decode(ids) == byte.decode(ids)
                and auto.decode(ids, skip_special_tokens=True) == byte.decode(ids)), ids


def test_hf_tokenizer_export_copies_its_files(tmp_path):
    (tmp_path / "tok").mkdir()
    _train_tiny_tokenizer(tmp_path / "tok" / "tokenizer.json")
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    files = HFTokenizer(str(tmp_path / "tok")).hf_files()
    assert sorted(files) == ["tokenizer.json", "tokenizer_config.json"]  # no special_tokens_map.json beside it
    for name, data in files.items():
        assert data == (tmp_path / "tok" / name).read_bytes()


def test_save_pretrained_writes_the_extra_files_and_refuses_bad_names(tmp_path):
    import torch

    from torchtitan_glm.models.glm5 import Glm5Model, get_flavor, save_pretrained

    torch.manual_seed(0)
    model = Glm5Model(get_flavor("debug"))
    files = ByteTokenizer().hf_files()
    save_pretrained(model, tmp_path / "hf", extra_files=files)
    assert {n: (tmp_path / "hf" / n).read_bytes() for n in files} == files
    for bad in ("config.json", "model.safetensors", "../tokenizer.json", "sub/tokenizer.json"):
        with pytest.raises(ValueError, match="extra file"):
            save_pretrained(model, tmp_path / "bad", extra_files={bad: b"x"})
        assert not (tmp_path / "bad").exists()


def test_hf_export_of_a_bare_tokenizer_json_declares_the_trainers_eos(tmp_path):
    """A folder holding only tokenizer.json: the export gets a tokenizer_config.json naming the eos (and pad) the
    trainer resolved, so transformers' AutoTokenizer loads the same specials; an existing one passes through."""
    from transformers import AutoTokenizer

    (tmp_path / "tok").mkdir()
    _train_tiny_tokenizer(tmp_path / "tok" / "tokenizer.json")
    tok = HFTokenizer(str(tmp_path / "tok"))
    files = tok.hf_files()
    assert sorted(files) == ["tokenizer.json", "tokenizer_config.json"]
    auto = AutoTokenizer.from_pretrained(str(_write(tmp_path / "export", files)))
    assert auto.eos_token == "<|endoftext|>" and auto.eos_token_id == tok.eos_id
    assert auto.pad_token_id == tok.pad_id and auto.bos_token is None
    assert auto(TEXT, add_special_tokens=False)["input_ids"] == tok.encode(TEXT)
    # re-read as the trainer would: the same specials
    again = HFTokenizer(str(tmp_path / "export"))
    assert (again.bos_id, again.eos_id, again.pad_id) == (tok.bos_id, tok.eos_id, tok.pad_id)


def test_a_tokenizer_without_eos_is_a_setting_error(tmp_path):
    from torchtitan_glm.components.errors import EXIT_USAGE

    _train_tiny_tokenizer(tmp_path / "tokenizer.json", specials=("<unk>",))
    with pytest.raises(TokenizerError, match=r"data\.tokenizer: tokenizer .*tokenizer\.json has no eos token") as e:
        HFTokenizer(str(tmp_path))
    assert e.value.exit_code == EXIT_USAGE
