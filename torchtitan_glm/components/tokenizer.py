"""Tokenizers: a built-in byte-level one (no files needed) and a wrapper over an HF `tokenizer.json`.

Both expose encode(text) -> list[int] (no special tokens added; the data pipeline adds eos), decode(ids) -> str,
vocab_size, bos_id, eos_id and pad_id, and hf_files(): the files an HF export carries so that its folder loads as
the same tokenizer (`tokenizers`, transformers' AutoTokenizer, serving engines).
"""

from __future__ import annotations

import json
import os
from typing import Protocol, Sequence

from torchtitan_glm.components.errors import TokenizerError
from torchtitan_glm.config import DataConfig

__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer", "build_tokenizer", "check_vocab_fits"]


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then bos=256, eos=257, pad=258 (vocab 259; fits the debug model's 512)."""

    vocab_size = 259
    bos_id = 256
    eos_id = 257
    pad_id = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Specials are dropped; invalid UTF-8 (e.g. a row cut mid-character) becomes U+FFFD."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    SPECIAL_NAMES = ("<|byte_bos|>", "<|byte_eos|>", "<|byte_pad|>")  # ids 256, 257, 258 in an HF export

    def hf_files(self) -> dict[str, bytes]:
        """tokenizer.json and tokenizer_config.json of the same ids, decoding as `decode` does: byte-level (GPT-2's
        byte-to-character map) with a vocabulary of the 256 byte characters (id = byte) and no merges, and the
        specials as added tokens. Its decoder turns the bytes back into text replacing only invalid UTF-8, as
        `decode` does; a byte-fallback tokenizer would turn a whole run of bytes into U+FFFD for one bad byte. As
        in any HF tokenizer, a literal special name in the text encodes as that special."""
        from tokenizers import Tokenizer as _HFTok
        from tokenizers import decoders, models, pre_tokenizers

        tok = _HFTok(models.BPE(vocab={c: b for b, c in _byte_level_chars().items()}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(list(self.SPECIAL_NAMES))
        bos, eos, pad = self.SPECIAL_NAMES
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "pad_token": pad,
                  "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False}
        return {"tokenizer.json": tok.to_str().encode(), "tokenizer_config.json": json.dumps(config, indent=2).encode()}


def _byte_level_chars() -> dict[int, str]:
    """The character `tokenizers`' ByteLevel pre-tokenizer writes for each byte (GPT-2's map: the printable
    Latin-1 bytes stand for themselves, the other 68 take the characters from U+0100 on, in byte order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = (b for b in range(256) if b not in keep)
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "[EOS]")
_BOS_NAMES = ("<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>", "[BOS]")
_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]")


class HFTokenizer:
    """A `tokenizers.Tokenizer` loaded from tokenizer.json.

    Special ids come from a sibling tokenizer_config.json (bos_token/eos_token/pad_token) when present, otherwise
    from common special-token names. An eos token is required: it separates packed documents.
    """

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as _HFTok

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise TokenizerError(f"data.tokenizer: tokenizer file not found: {file}")
        try:
            self._tok = _HFTok.from_file(file)
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise TokenizerError(f"data.tokenizer: cannot load tokenizer {file}: {e}") from e
        self.path = file
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        declared = _read_declared_specials(os.path.join(os.path.dirname(file), "tokenizer_config.json"))
        self.bos_id = self._special_id(declared.get("bos_token"), _BOS_NAMES)
        eos = self._special_id(declared.get("eos_token"), _EOS_NAMES)
        if eos is None:
            raise TokenizerError(f"data.tokenizer: tokenizer {file} has no eos token (looked for "
                                 f"{list(_EOS_NAMES)} and tokenizer_config.json eos_token); packing needs one to "
                                 "separate documents", usage=True)
        self.eos_id: int = eos
        self.pad_id = self._special_id(declared.get("pad_token"), _PAD_NAMES)

    def _special_id(self, declared: str | None, names: Sequence[str]) -> int | None:
        for name in ([declared] if declared else []) + list(names):
            idx = self._tok.token_to_id(name)
            if idx is not None:
                return idx
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")  # copied from beside tokenizer.json

    def hf_files(self) -> dict[str, bytes]:
        """Its tokenizer.json and the side files found beside it, byte for byte. Without a tokenizer_config.json
        beside it, one is written declaring the specials this tokenizer resolved (eos, and bos/pad when found):
        otherwise transformers' AutoTokenizer loads the export with eos None, not the eos training packed with."""
        folder = os.path.dirname(self.path)
        files = {"tokenizer.json": self.path}
        files.update({n: p for n in self.SIDE_FILES if os.path.isfile(p := os.path.join(folder, n))})
        out = {}
        for name, path in files.items():
            try:
                with open(path, "rb") as f:
                    out[name] = f.read()
            except OSError as e:
                raise TokenizerError(f"data.tokenizer: cannot read {path} for the HF export: {e.strerror or e}") \
                    from None
        if "tokenizer_config.json" not in out:
            out["tokenizer_config.json"] = json.dumps(self._resolved_config(), indent=2).encode()
        return out

    def _resolved_config(self) -> dict[str, object]:
        """A tokenizer_config.json naming the specials resolved from tokenizer.json's names (no special tokens
        added on encode, as in training)."""
        config: dict[str, object] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        for key, idx in (("bos_token", self.bos_id), ("eos_token", self.eos_id), ("pad_token", self.pad_id)):
            if idx is not None:
                config[key] = self._tok.id_to_token(idx)
        config["clean_up_tokenization_spaces"] = False
        return config


def _read_declared_specials(path: str) -> dict[str, str]:
    """bos/eos/pad token strings from an HF tokenizer_config.json (values may be strings or {"content": ...})."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise TokenizerError(f"data.tokenizer: cannot read {path}: {e}") from e
    out = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        value = cfg.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def build_tokenizer(*, cfg: DataConfig) -> ByteTokenizer | HFTokenizer:
    """`data.tokenizer`: "byte" for the built-in tokenizer, else a tokenizer.json path (or its directory)."""
    return ByteTokenizer() if cfg.tokenizer == "byte" else HFTokenizer(cfg.tokenizer)


def check_vocab_fits(tokenizer: ByteTokenizer | HFTokenizer, *, vocab_size: int, model: str) -> None:
    """TokenizerError unless every id the tokenizer can produce fits the model's embedding (checked before the
    model is built); `model` says where vocab_size came from."""
    if tokenizer.vocab_size > vocab_size:
        name = getattr(tokenizer, "path", "byte")
        raise TokenizerError(f"data.tokenizer {name} has {tokenizer.vocab_size} tokens but the model ({model}) has "
                             f"vocab_size {vocab_size}: use a tokenizer that fits or a model with a larger vocab_size",
                             usage=True)
