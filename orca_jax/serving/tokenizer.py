"""Text to token ids and back, for the server.

- `HFTokenizer`: a checkpoint folder's `tokenizer.json` through the `tokenizers`
  library, its end-of-sequence token and chat template from `tokenizer_config.json`
  where present. The template is rendered with jinja2 when it is installed;
  without it (or without a template) messages are rendered by `plain_chat`.
- `ByteTokenizer`: the random-weight presets' built-in tokenizer, so a server of
  `tiny` needs no download: token id = the byte of the UTF-8 text (vocabularies of
  at least 256 ids), no special tokens, no end-of-sequence token (an answer runs to
  its max_tokens). Ids of 256 and up, which the random model may sample, decode as
  nothing.

Decoding is incremental (`Detokenizer`): text is handed out only once its bytes
make whole characters.

`write_byte_tokenizer` writes the byte tokenizer as a Hugging Face tokenizer folder
(tokenizer.json, tokenizer_config.json), for clients that count or make tokens
themselves (vLLM's `bench serve`): it encodes and decodes as `ByteTokenizer`.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Protocol, Sequence


class Tokenizer(Protocol):
    """What the server needs of a tokenizer."""

    eos_token_id: Optional[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> str: ...


def plain_chat(messages: Sequence[dict[str, str]]) -> str:
    """The documented fallback chat rendering: one `role: content` line per message, then
    `assistant:` for the answer to follow."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


class ByteTokenizer:
    """UTF-8 bytes as token ids (0..255)."""

    eos_token_id: Optional[int] = None

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 256:
            raise ValueError(f"the byte tokenizer needs a vocabulary of 256 ids or more; the "
                             f"model has {vocab_size}: give --tokenizer a tokenizer.json")

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> str:
        return plain_chat(messages)


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (with `tokenizer_config.json` beside it, if any)."""

    def __init__(self, folder: str) -> None:
        from tokenizers import Tokenizer as _Tokenizer  # the `serve` extra

        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(f"--tokenizer: {folder} has no tokenizer.json")
        self._tokenizer = _Tokenizer.from_file(path)
        config: dict = {}
        config_path = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(config_path):
            with open(config_path) as f:
                config = json.load(f)
        self._template: Optional[str] = config.get("chat_template") if isinstance(
            config.get("chat_template"), str) else None
        self._special = {key: _token_text(config.get(key))
                         for key in ("bos_token", "eos_token")}
        eos = self._special["eos_token"]
        self.eos_token_id = self._tokenizer.token_to_id(eos) if eos else None
        self._add_bos = bool(config.get("add_bos_token", False))

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=self._add_bos).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> str:
        if self._template is None:
            return plain_chat(messages)
        try:
            import jinja2
        except ImportError:
            return plain_chat(messages)
        template = jinja2.Environment().from_string(self._template)
        return template.render(messages=list(messages), add_generation_prompt=True,
                               **{k: v or "" for k, v in self._special.items()})


def _token_text(value: object) -> Optional[str]:
    """A special token as tokenizer_config.json gives it: text, or `{"content": text}`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _byte_chars() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (the ByteLevel pre-tokenizer's)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars = {b: chr(b) for b in printable}
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + len(chars) - len(printable))
    return chars


def byte_tokenizer_files() -> dict[str, dict]:
    """`ByteTokenizer` as a Hugging Face tokenizer folder's files (name -> JSON).

    A byte-level BPE with no merges: the vocabulary is the 256 bytes, id = byte value;
    its decoder replaces invalid UTF-8 as `bytes.decode(errors="replace")` does and
    drops ids it does not know (256 and up), as `ByteTokenizer.decode`. No special tokens.
    """
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                  "use_regex": False}
    vocab = {char: byte for byte, char in _byte_chars().items()}
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []}}
    # transformers loads the folder as a fast tokenizer with no model config beside it.
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
              "clean_up_tokenization_spaces": False, "model_max_length": 1 << 30}
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config}


def write_byte_tokenizer(folder: str) -> str:
    """Writes `byte_tokenizer_files()` into `folder` (made if missing); returns it."""
    os.makedirs(folder, exist_ok=True)
    for name, content in byte_tokenizer_files().items():
        with open(os.path.join(folder, name), "w") as f:
            json.dump(content, f, ensure_ascii=False)
    return folder


def load_tokenizer(folder: Optional[str], vocab_size: int) -> Tokenizer:
    """The folder's tokenizer.json, or the byte tokenizer when no folder is given."""
    return ByteTokenizer(vocab_size) if folder is None else HFTokenizer(folder)


class Detokenizer:
    """One answer's text as its tokens come: `add(ids)` returns the new text."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""  # handed out so far

    def add(self, ids: Sequence[int]) -> str:
        self.ids.extend(ids)
        text = self._tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # a character's bytes still to come
            return ""
        new = text[len(self.text):] if text.startswith(self.text) else ""
        self.text = text
        return new
