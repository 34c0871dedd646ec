"""Grammar-constrained decoding: token masks from a JSON schema, a regex or a Lark grammar.

Built on llguidance (Microsoft's guidance-ai; the ``grammar`` extra), the structured-output
engine vLLM, SGLang and llama.cpp also use. It was chosen over xgrammar and outlines-core
because it installs from one 3 MB wheel with no dependencies (xgrammar 0.2.8 pulls triton,
outlines-core needs a vocabulary index built per schema), runs on any CPU, accepts
JSON Schema, regex and Lark, compiles a schema lazily in about a millisecond, and
computes a step's masks for many sequences in parallel outside the GIL.

A :class:`Grammar` is compiled once per request; each sequence decoding it owns a
:class:`GrammarMatcher` (its parser state), whose mask for the next token is written into
one row of a step's ``[B, ceil(V/32)]`` int32 bitmask
(:func:`attnlab.functional.sampling.unpack_bitmask` reads the layout).
"""

from __future__ import annotations

import json
import weakref
from typing import Any

import torch
from torch import Tensor

__all__ = ["Grammar", "GrammarError", "GrammarMatcher", "fill_bitmask"]


class GrammarError(ValueError):
    """A grammar (or schema) the grammar library cannot compile; the message says why."""


def _llguidance() -> Any:
    try:  # not llguidance.torch: it builds a torch.compile kernel at import (seconds)
        import llguidance
        import llguidance.hf
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "structured outputs need llguidance: pip install 'attnlab[grammar]'"
        ) from e
    return llguidance


_TOKENIZERS: weakref.WeakKeyDictionary[Any, dict[int, Any]] = weakref.WeakKeyDictionary()


def _ll_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of a transformers fast tokenizer (built once per tokenizer)."""
    ll = _llguidance()
    per = _TOKENIZERS.setdefault(tokenizer, {})
    if vocab_size not in per:
        try:
            per[vocab_size] = ll.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        except ValueError as e:
            raise GrammarError(f"structured outputs need a fast tokenizer: {e}") from None
    return per[vocab_size]


class Grammar:
    """A compiled grammar for one tokenizer and vocabulary.

    Build one with :meth:`json_schema`, :meth:`json_object`, :meth:`regex` or :meth:`lark`.

    Raises:
        GrammarError: the library cannot compile the grammar (its reason in the message).
    """

    def __init__(self, grammar: str, tokenizer: Any, vocab_size: int) -> None:
        ll = _llguidance()
        self.vocab_size = vocab_size
        self._tok = _ll_tokenizer(tokenizer, vocab_size)
        problem = ll.LLMatcher.validate_grammar(grammar, self._tok)
        if problem:
            raise GrammarError(problem)
        self._proto = ll.LLMatcher(self._tok, grammar, log_level=0)
        if self._proto.is_error():
            raise GrammarError(self._proto.get_error())
        self.source = grammar

    @classmethod
    def json_schema(cls, schema: dict[str, Any], tokenizer: Any, vocab_size: int) -> Grammar:
        """JSON text valid against ``schema`` (compact separators: ``,`` and ``:``)."""
        ll = _llguidance()
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema must be an object, got {schema!r}")
        options = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
        try:
            text = ll.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options)
        except (ValueError, TypeError) as e:
            raise GrammarError(str(e)) from None
        return cls(text, tokenizer, vocab_size)

    @classmethod
    def json_object(cls, tokenizer: Any, vocab_size: int) -> Grammar:
        """Any JSON object (``response_format: {"type": "json_object"}``)."""
        return cls.json_schema({"type": "object"}, tokenizer, vocab_size)

    @classmethod
    def regex(cls, pattern: str, tokenizer: Any, vocab_size: int) -> Grammar:
        """Text matching the regular expression ``pattern`` in full."""
        return cls(_llguidance().grammar_from("regex", pattern), tokenizer, vocab_size)

    @classmethod
    def lark(cls, grammar: str, tokenizer: Any, vocab_size: int) -> Grammar:
        """Text of a Lark grammar (llguidance's dialect)."""
        return cls(_llguidance().grammar_from("lark", grammar), tokenizer, vocab_size)

    def matcher(self) -> GrammarMatcher:
        """A fresh parser state for one sequence."""
        return GrammarMatcher(self._proto.deep_copy(), self.vocab_size)


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size

    def fill(self, bitmask: Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (a contiguous int32 CPU tensor)."""
        assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and not bitmask.is_cuda
        words = bitmask[row]
        self._m.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def advance(self, token: int) -> None:
        """Consume the chosen token.

        Raises:
            GrammarError: the token breaks the grammar (a mask was not applied).
        """
        if not self._m.consume_token(int(token)):
            raise GrammarError(f"token {token} is not allowed here: {self._m.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete and accepts nothing more but EOS."""
        return bool(self._m.is_stopped())

    @property
    def accepting(self) -> bool:
        """What was generated so far is a complete sentence of the grammar."""
        return bool(self._m.is_accepting())


def fill_bitmask(matchers: list[GrammarMatcher]) -> Tensor:
    """The next-token masks of ``matchers`` as one ``[M, ceil(V/32)]`` int32 bitmask,
    computed by llguidance in parallel outside the GIL."""
    vocab = matchers[0].vocab_size
    bitmask = torch.full((len(matchers), (vocab + 31) // 32), -1, dtype=torch.int32)
    rows, words = bitmask.shape
    pairs = [(m._m, i) for i, m in enumerate(matchers)]
    _executor().unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, rows)
    return bitmask


_EXECUTOR: list[Any] = []


def _executor() -> Any:
    if not _EXECUTOR:
        _EXECUTOR.append(_llguidance().LLExecutor())
    return _EXECUTOR[0]
