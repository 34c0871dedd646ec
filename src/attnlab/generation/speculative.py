"""Speculative decoding: draft a few tokens cheaply, verify them in one forward of the model.

Two drafters: **prompt lookup** (Saxena, 2023: the continuation of the latest earlier
occurrence of the last n-gram in the context; free, and strong when the output repeats
spans of the prompt, as edits and summaries with quotes do) and a **draft model** (any
smaller causal LM with the same vocabulary; Leviathan et al., 2023; Chen et al., 2023).
The model scores the last token and the ``k`` drafts in one forward over its KV cache;
:func:`attnlab.generation.sampler.speculative_verify` keeps a prefix (greedy: the drafts
that equal the argmax; sampling: the rejection rule, which leaves the output distributed
as plain sampling), the cache is cut back to the kept tokens, and one more token comes
from the same forward. Greedy output is the plain greedy output.

Batch size 1 (each row would accept a different number of tokens).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from attnlab._validate import check_int
from attnlab.cache.kv_cache import DynamicKVCache
from attnlab.functional.sampling import (
    check_finite_logits,
    check_sampling,
    top_k_filter,
    top_p_filter,
)
from attnlab.generation.inputs import check_inputs
from attnlab.generation.sampler import speculative_verify

__all__ = [
    "NgramIndex",
    "SpeculativeStats",
    "generate_speculative",
    "prompt_lookup",
    "speculative_stream",
]


def prompt_lookup(tokens: Sequence[int], *, max_ngram: int = 3, num_draft: int = 8) -> list[int]:
    """Up to ``num_draft`` tokens that followed the latest earlier occurrence of the
    context's last n-gram (longest n first, ``max_ngram`` down to 1); ``[]`` if none."""
    n_tok = len(tokens)
    for n in range(min(max_ngram, n_tok - 1), 0, -1):
        tail = list(tokens[n_tok - n :])
        for start in range(n_tok - n - 1, -1, -1):  # latest occurrence first
            if list(tokens[start : start + n]) == tail:
                follow = list(tokens[start + n : start + n + num_draft])
                if follow:
                    return follow
    return []


@dataclass
class NgramIndex:
    """Prompt lookup over a growing token list, in constant time per new token.

    :meth:`draft` returns what :func:`prompt_lookup` returns (the continuation of the
    latest earlier occurrence of the last n-gram, longest ``n`` first), from a map of
    every n-gram to its latest start that is built as the tokens grow, instead of a scan
    of the whole context each step. ``generate(speculative="prompt_lookup")`` and the
    serving engine (:mod:`attnlab.serving.speculative`) draft with it.

    Attributes:
        max_ngram: the longest n-gram matched.
    """

    max_ngram: int
    _latest: dict[tuple[int, ...], int] = field(default_factory=dict)
    _indexed: int = 0  # n-grams ending before this token are in ``_latest``

    def draft(self, tokens: Sequence[int], num_draft: int) -> list[int]:
        """Up to ``num_draft`` tokens after the latest earlier occurrence of the last
        n-gram of ``tokens`` (a list that only grows between calls); ``[]`` if none."""
        n_tok = len(tokens)
        # an n-gram may be matched when a token follows it before the tail: end <= n_tok - 1
        for end in range(self._indexed + 1, n_tok):
            for n in range(1, min(self.max_ngram, end) + 1):
                self._latest[tuple(tokens[end - n : end])] = end - n
        self._indexed = max(self._indexed, n_tok - 1)
        for n in range(min(self.max_ngram, n_tok - 1), 0, -1):
            start = self._latest.get(tuple(tokens[n_tok - n :]))
            if start is not None:
                return list(tokens[start + n : start + n + num_draft])
        return []


@dataclass
class SpeculativeStats:
    """What a speculative run did: ``forwards`` of the model, ``drafted`` and
    ``accepted`` draft tokens (``accepted / drafted`` is the acceptance rate)."""

    forwards: int = 0
    drafted: int = 0
    accepted: int = 0


def _probs(logits: Tensor, temperature: float, top_k: int | None, top_p: float | None) -> Tensor:
    scores = logits.float() / temperature
    if top_k is not None:
        scores = top_k_filter(scores, top_k)
    if top_p is not None:
        scores = top_p_filter(scores, top_p)
    return torch.softmax(scores, dim=-1)


class _DraftModel:
    """A draft model with its own cache, kept in step with the committed tokens."""

    def __init__(self, model: nn.Module, capacity: int) -> None:
        self.model = model
        self.cache = model.new_cache(max_length=capacity)  # type: ignore[operator]

    def draft(self, seq: list[int], k: int, sample: Any) -> tuple[list[int], Tensor | None]:
        common = min(self.cache.length, len(seq) - 1)
        self.cache.set_length(common)
        feed = torch.tensor([seq[common:]])
        out: list[int] = []
        probs: list[Tensor] = []
        for _ in range(k):
            logits = self.model(
                feed, past_key_values=self.cache, use_cache=True, logits_to_keep=1
            ).logits[0, -1]
            tok, q = sample(logits)
            out.append(tok)
            if q is not None:
                probs.append(q)
            feed = torch.tensor([[tok]])
        return out, (torch.stack(probs) if probs else None)


def speculative_stream(
    model: nn.Module,
    input_ids: Tensor,
    max_new_tokens: int,
    *,
    draft: str | nn.Module = "prompt_lookup",
    num_draft: int = 8,
    max_ngram: int = 3,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    stats: SpeculativeStats | None = None,
) -> Iterator[int]:
    """Yield new tokens one by one, drafted ``num_draft`` at a time and verified.

    Args:
        model: the causal LM (an attnlab decoder with ``new_cache``).
        input_ids: ``[1, P]``.
        max_new_tokens: tokens to produce at most.
        draft: ``"prompt_lookup"`` or a draft model with the same vocabulary.
        num_draft: drafts per verification forward.
        max_ngram: longest n-gram prompt lookup matches.
        do_sample, temperature, top_k, top_p, generator: as in ``generate``.
        eos_token_id: stop after one of these.
        stats: filled with forwards, drafted and accepted counts.

    Raises:
        ValueError: a batch of more than one row, a draft model of another vocabulary,
            or a bad ``num_draft``/``max_ngram``.
    """
    check_int("num_draft", num_draft, min_value=1)
    check_int("max_ngram", max_ngram, min_value=1)
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(
            f"speculative decoding runs one sequence: input_ids must be [1, P], got "
            f"{tuple(input_ids.shape)}"
        )
    vocab = model.config.vocab_size  # type: ignore[union-attr]
    drafter: _DraftModel | None = None
    capacity = input_ids.shape[1] + max_new_tokens + num_draft + 1
    if isinstance(draft, nn.Module):
        dv = getattr(getattr(draft, "config", None), "vocab_size", None)
        if dv != vocab:
            raise ValueError(f"the draft model's vocabulary ({dv}) must be the model's ({vocab})")
        drafter = _DraftModel(draft, capacity)
    elif draft != "prompt_lookup":
        raise ValueError(f"draft must be 'prompt_lookup' or a draft model, got {draft!r}")
    eos = (
        set()
        if eos_token_id is None
        else {eos_token_id}
        if isinstance(eos_token_id, int)
        else set(eos_token_id)
    )
    st = stats if stats is not None else SpeculativeStats()
    lookup = NgramIndex(max_ngram)  # constant time per new token, not a scan of the context

    def pick(logits: Tensor) -> tuple[int, Tensor | None]:
        if not do_sample:
            return int(logits.argmax()), None
        q = _probs(logits[None], temperature, top_k, top_p)[0]
        return int(torch.multinomial(q, 1, generator=generator)), q

    cache = model.new_cache(max_length=capacity)  # type: ignore[operator]
    if not all(isinstance(c, DynamicKVCache) for c in cache.layers):
        raise ValueError(
            "speculative decoding cuts the cache back to the kept tokens: every layer must "
            "hold a growing KV cache (no recurrent state, no rolling window)"
        )
    logits = model(input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    check_finite_logits(logits[:, -1], step=0)
    st.forwards += 1
    seq = input_ids[0].tolist()
    tok, _ = pick(logits[0, -1])
    produced = 0
    while True:
        seq.append(tok)
        produced += 1
        yield tok
        if tok in eos or produced >= max_new_tokens:
            return
        k = min(num_draft, max_new_tokens - produced)
        q: Tensor | None = None
        if drafter is not None:
            d, q = drafter.draft(seq, k, pick)
        else:
            d = lookup.draft(seq, k)
        start = cache.length  # the committed tokens but the last
        out = model(torch.tensor([[tok, *d]]), past_key_values=cache, use_cache=True).logits[0]
        check_finite_logits(out, step=produced)
        st.forwards += 1
        st.drafted += len(d)
        if not do_sample:
            best = out.argmax(dim=-1).tolist()  # [k + 1]
            a = next((i for i, t in enumerate(d) if t != best[i]), len(d))
            nxt = best[a]
        else:
            a, nxt = speculative_verify(
                _probs(out, temperature, top_k, top_p),
                torch.tensor(d, dtype=torch.long),
                q,
                generator=generator,
            )
        st.accepted += a
        cache.set_length(start + 1 + a)  # the last token and the kept drafts
        for t in d[:a]:
            seq.append(t)
            produced += 1
            yield t
            if t in eos or produced >= max_new_tokens:
                return
        tok = nxt


def generate_speculative(
    model: nn.Module,
    input_ids: Tensor,
    max_new_tokens: int,
    attention_mask: Tensor | None,
    cache: Any,
    compile: bool | None,
    speculative: str | nn.Module,
    **kwargs: Any,
) -> Tensor:
    """``generate(speculative=...)``: the combinations it refuses, then the drafted loop."""
    check_sampling(
        do_sample=kwargs["do_sample"],
        temperature=kwargs["temperature"],
        top_k=kwargs["top_k"],
        top_p=kwargs["top_p"],
    )
    check_inputs(model, input_ids, max_new_tokens, attention_mask)
    if getattr(model, "is_encoder_decoder", False) or not hasattr(model, "new_cache"):
        raise ValueError(
            f"speculative decoding needs a decoder-only model, got {type(model).__name__}"
        )
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError("speculative decoding runs one unpadded row: drop the padding")
    if cache is not None or compile is True:
        raise ValueError("speculative decoding makes its own cache and runs eagerly: "
                         "pass neither cache= nor compile=True")  # fmt: skip
    if getattr(model.config, "sliding_window", None) is not None:
        raise ValueError("speculative decoding cuts the cache back: a sliding-window cache cannot")
    new = list(speculative_stream(model, input_ids, max_new_tokens, draft=speculative, **kwargs))
    tail = torch.tensor([new], dtype=input_ids.dtype, device=input_ids.device)
    return torch.cat([input_ids, tail], dim=1)
