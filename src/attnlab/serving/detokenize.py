"""Incremental detokenisation that never emits a broken UTF-8 character.

A byte-level BPE token (GPT-2, Llama 3, ...) can end inside a multi-byte UTF-8
character: decoding the tokens so far then ends with U+FFFD, which must not be sent
to a client, because the next token completes the character. The detokeniser keeps
two offsets into the token list (the scheme of Hugging Face text-generation-inference
and vLLM): it decodes a short window of recent tokens with and without the newest
ones and emits the difference only when it does not end in U+FFFD. Pieces emitted
this way concatenate to the text of all tokens (for tokenizers whose decoding is
concatenative, as byte-level BPE's is).
"""

from __future__ import annotations

from typing import Any

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text pieces.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=...)`` (a transformers
            tokenizer).
        prompt_ids: the prompt's last few tokens give the first piece its context
            (a leading space of a SentencePiece token is kept only after a word); a
            prompt that ends inside a character gives none (the completion's text is
            then its own tokens' text).
        skip_special_tokens: leave special tokens out of the text.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: list[int] | None = None,
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids or [])[-4:]
        if context and self._decode(context).endswith(_REPLACEMENT):
            context = []
        self.ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens))

    def add(self, token_id: int) -> str:
        """Add one token; return the new text that is complete (may be empty)."""
        self.ids.append(int(token_id))
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if len(after) > len(before) and not after.endswith(_REPLACEMENT):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """The text of tokens held back (an incomplete character at the very end)."""
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return after[len(before) :] if len(after) > len(before) else ""
