"""Tokenizers for training: UTF-8 bytes, or a byte-level BPE trained on the training split.

Both save as a ``tokenizer.json`` that transformers' ``AutoTokenizer`` (and so
``attnlab generate``) loads. For bytes, token ``i`` is byte ``i``: the file holds a BPE
model with the 256 byte symbols and no merges, behind the byte-level pre-tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["BPETokenizer", "ByteTokenizer", "TextTokenizer", "build_tokenizer"]

MASK_TOKEN = "[MASK]"


def _require_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("this needs the tokenizers library: pip install 'attnlab[hf]'") from e
    return tokenizers


def _byte_symbols() -> list[str]:
    """The byte-level alphabet: the printable symbol standing for each byte (GPT-2's map)."""
    tk = _require_tokenizers()
    alphabet = tk.pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel maps printable bytes to themselves and the others to U+0100 onwards, in
    # byte order (Radford et al., 2019, GPT-2's bytes_to_unicode).
    printable = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    out: dict[int, str] = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + n)
            n += 1
    symbols = [out[b] for b in range(256)]
    assert set(symbols) == set(alphabet)
    return symbols


class TextTokenizer:
    """Text -> ids, the vocabulary, bytes per token, and a saved ``tokenizer.json``."""

    def __init__(self, tok: Any, *, with_mask: bool) -> None:
        self._tok = tok
        self.mask_token_id: int | None = None
        if with_mask:
            tok.add_special_tokens([MASK_TOKEN])
            self.mask_token_id = tok.token_to_id(MASK_TOKEN)
        self.vocab_size: int = tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(e.ids) for e in self._tok.encode_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids))

    def token_bytes(self) -> Tensor:
        """``[V]`` UTF-8 bytes each token stands for (0 for special tokens)."""
        symbols = {s: b for b, s in enumerate(_byte_symbols())}
        out = torch.zeros(self.vocab_size, dtype=torch.long)
        for token, i in self._tok.get_vocab().items():
            if token != MASK_TOKEN:
                out[i] = sum(1 for c in token if c in symbols)
        return out

    def save(self, folder: Path) -> None:
        """``tokenizer.json`` + ``tokenizer_config.json`` (transformers' fast tokenizer)."""
        folder.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(folder / "tokenizer.json"))
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        if self.mask_token_id is not None:
            config["mask_token"] = MASK_TOKEN
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _byte_level(tok: Any) -> Any:
    tk = _require_tokenizers()
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tk.decoders.ByteLevel()
    return tok


class ByteTokenizer(TextTokenizer):
    """Token ``i`` is byte ``i`` (vocabulary 256, plus ``[MASK]`` for masked LMs)."""

    def __init__(self, *, with_mask: bool = False) -> None:
        tk = _require_tokenizers()
        vocab = {s: b for b, s in enumerate(_byte_symbols())}
        super().__init__(_byte_level(tk.Tokenizer(tk.models.BPE(vocab, []))), with_mask=with_mask)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))  # what the saved tokenizer.json computes, faster

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]


class BPETokenizer(TextTokenizer):
    """A byte-level BPE (Sennrich et al., 2016; GPT-2's byte variant) trained on ``texts``."""

    def __init__(self, texts: Iterable[str], *, vocab_size: int, with_mask: bool = False) -> None:
        tk = _require_tokenizers()
        tok = tk.Tokenizer(tk.models.BPE())
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        super().__init__(tok, with_mask=with_mask)


def build_tokenizer(
    kind: str, texts: Iterable[str] = (), *, vocab_size: int = 4096, with_mask: bool = False
) -> TextTokenizer:
    """``"bytes"`` or ``"bpe"`` (trained on ``texts``)."""
    if kind == "bytes":
        return ByteTokenizer(with_mask=with_mask)
    if kind == "bpe":
        return BPETokenizer(texts, vocab_size=vocab_size, with_mask=with_mask)
    raise ValueError(f"tokenizer must be 'bytes' or 'bpe', got {kind!r}")
