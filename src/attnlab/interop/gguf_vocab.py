"""A transformers byte-level BPE tokenizer -> GGUF's ``tokenizer.*`` metadata (for writing).

GGUF stores a tokenizer as its vocabulary in id order (``tokenizer.ggml.tokens``), a
type per token (1 normal, 3 control, 4 user-defined, 5 unused), the merges as
``"a b"`` strings, the special token ids, the chat template, and ``tokenizer.ggml.pre``,
the name of the pre-tokenizer split llama.cpp and transformers apply (llama.cpp refuses a
file whose name it does not know: ``"gpt-2"`` for GPT-2's split, ``"smollm"``, ``"default"``,
or one of the names transformers and llama.cpp share for a split regex). Only byte-level
BPE (``tokenizer.ggml.model = "gpt2"``: GPT-2, Llama 3, SmolLM, Qwen2 ...) is written.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["tokenizer_metadata"]

_NORMAL, _CONTROL, _USER, _UNUSED = 1, 3, 4, 5


def _pre_name(pre: dict[str, Any] | None) -> str:
    """llama.cpp's name for the split a tokenizer.json pre-tokenizer applies."""
    if not pre:
        return "default"
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"  # llama.cpp's name (llama-vocab.cpp); "gpt2" is the model name
        # and an unknown pre-tokenizer: llama.cpp refuses to load such a file
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits"):
        return "smollm"  # SmolLM's own tokenizer.json: single digits, then GPT-2's split
    split = next((p for p in parts if p.get("type") == "Split"), None)
    if split is not None:
        regex = split.get("pattern", {}).get("Regex")
        try:
            from transformers.integrations.gguf.gguf_tokenizer_mapping import (
                GGUF_PRE_TOKENIZER_SPLITS,
            )
        except ImportError:  # pragma: no cover - depends on the installed transformers
            GGUF_PRE_TOKENIZER_SPLITS = {}
        for name, pattern in GGUF_PRE_TOKENIZER_SPLITS.items():
            if pattern == regex:
                return name
    return "default"


def tokenizer_metadata(tokenizer: Any, config: Any) -> dict[str, Any]:
    """GGUF ``tokenizer.*`` metadata for a transformers fast byte-level BPE tokenizer.

    The vocabulary is padded to ``config.vocab_size`` with ``[PAD{i}]`` tokens marked
    unused, as llama.cpp's converter does.

    Raises:
        ValueError: not a fast tokenizer, not BPE with a byte-level pre-tokenizer, a
            vocabulary with gaps, or larger than the model's.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            f"to_gguf stores a transformers fast tokenizer, got {type(tokenizer).__name__}"
        )
    data = json.loads(backend.to_str())
    model = data.get("model", {})
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(data.get("pre_tokenizer")):
        raise ValueError(
            f"to_gguf stores byte-level BPE tokenizers; this one is {model.get('type')!r} with "
            f"pre-tokenizer {(data.get('pre_tokenizer') or {}).get('type')!r}"
        )
    vocab: dict[str, int] = dict(model["vocab"])
    kinds = dict.fromkeys(vocab.values(), _NORMAL)
    for added in data.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        kinds[added["id"]] = _CONTROL if added.get("special") else _USER
    size = max(vocab.values()) + 1
    if size > config.vocab_size:
        raise ValueError(
            f"the tokenizer has {size} tokens, more than the model's vocab_size {config.vocab_size}"
        )
    tokens: list[str | None] = [None] * config.vocab_size
    for text, i in vocab.items():
        tokens[i] = text
    gaps = [i for i in range(size) if tokens[i] is None]
    if gaps:
        raise ValueError(f"the tokenizer's vocabulary has no token for ids {gaps[:8]}")
    for i in range(size, config.vocab_size):
        tokens[i] = f"[PAD{i}]"
        kinds[i] = _UNUSED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": _pre_name(data.get("pre_tokenizer")),
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [kinds[i] for i in range(config.vocab_size)],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.add_bos_token": bool(getattr(tokenizer, "add_bos_token", False)),
    }
    for attr, key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("unk_token_id", "unknown_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            meta[f"tokenizer.ggml.{key}"] = value
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and template:
        meta["tokenizer.chat_template"] = template
    return meta
