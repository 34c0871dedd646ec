"""Perplexity of a causal LM on a long text by the strided sliding window.

A text longer than the context is cut into windows of ``context`` tokens that start
``stride`` tokens apart; each token after the first is scored exactly once, in the first
window that contains it past the previous window's end, so it is predicted from up to
``context - stride`` tokens of left context (more for the tokens later in the window).
This is the evaluation the transformers perplexity guide describes
(https://huggingface.co/docs/transformers/perplexity), with the count of scored tokens
exact. ``stride == context`` gives disjoint windows (least context, fastest; the first
token of each later window is not scored, as in the guide); ``stride == 1`` gives every
token the full context (slowest).

Any model that takes ``input_ids`` and returns ``.logits`` works, attnlab's or
transformers', so both can be measured on the same tokens.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from attnlab._validate import check_int

__all__ = ["PerplexityResult", "cached_nll", "strided_perplexity", "windows"]


@dataclass(frozen=True)
class PerplexityResult:
    """What :func:`strided_perplexity` measured.

    Attributes:
        perplexity: ``exp(nll / tokens)``.
        nll: summed negative log-likelihood (nats, float64 accumulation).
        tokens: tokens scored (``len(ids) - 1``; fewer by one per extra window when
            ``stride == context``).
        windows: forward passes run.
        context: window length.
        stride: distance between window starts.
        seconds: wall time of the forward passes.
    """

    perplexity: float
    nll: float
    tokens: int
    windows: int
    context: int
    stride: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"tokens_per_second": self.tokens_per_second}


def windows(n: int, context: int, stride: int) -> Iterator[tuple[int, int, int]]:
    """``(begin, end, first_scored)`` for each window over ``n`` tokens.

    Tokens ``first_scored .. end - 1`` are scored in the window ``[begin, end)``, each
    from the logits at its previous position; together they cover ``1 .. n - 1`` once,
    except, when ``stride == context``, the first token of each window after the first
    (nothing before it is in its window).
    """
    scored_to = 1  # token 0 has no prediction
    begin = 0
    while scored_to < n:
        end = min(begin + context, n)
        first = max(scored_to, begin + 1)
        if end > first:
            yield begin, end, first
        scored_to = max(scored_to, end)
        begin += stride


@torch.no_grad()
def strided_perplexity(
    model: Any,
    ids: Tensor | list[int],
    *,
    context: int,
    stride: int | None = None,
    on_window: Callable[[int, int], None] | None = None,
    cache: Callable[[], Any] | None = None,
    chunk: int = 16,
) -> PerplexityResult:
    """Perplexity of ``model`` on the token ids ``ids`` by the strided sliding window.

    Args:
        model: a causal LM: ``model(input_ids=[1, L]).logits`` is ``[1, L, V]``.
        ids: the text's token ids, 1-D (at least 2).
        context: window length in tokens (at most the model's context window).
        stride: distance between window starts, ``1 <= stride <= context``; default
            ``context // 2`` (at least 1).
        on_window: called with ``(windows done, windows in all)`` after each window.
        cache: when given, a function returning a fresh model cache (e.g. a quantized KV
            cache, :func:`attnlab.cache.quantized.quantize_model_cache`): each window is
            then decoded through it ``chunk`` tokens a forward (:func:`cached_nll`), so
            the tokens are predicted from what the cache keeps.
        chunk: tokens per forward when ``cache`` is given.

    Raises:
        ValueError: fewer than 2 tokens, or a bad ``context``/``stride``.
    """
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
    n = int(ids.numel())
    if n < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {n}")
    check_int("context", context, min_value=2)
    check_int("chunk", chunk, min_value=1)
    stride = max(context // 2, 1) if stride is None else stride
    check_int("stride", stride, min_value=1)
    if stride > context:
        raise ValueError(f"stride ({stride}) must be at most context ({context})")
    plan = list(windows(n, context, stride))
    nll = 0.0
    scored = 0
    start = time.perf_counter()
    for k, (begin, end, first) in enumerate(plan, 1):
        if cache is not None:
            token_nll = cached_nll(model, ids[None, begin:end], cache(), chunk=chunk)
            nll += float(token_nll[first - 1 - begin :].sum())
        else:
            logits = model(input_ids=ids[None, begin:end]).logits[0]  # [end - begin, V]
            pred = logits[first - 1 - begin : end - 1 - begin].float()  # predicts first..end-1
            target = ids[first:end]
            logp = torch.log_softmax(pred, dim=-1).gather(-1, target[:, None])
            nll -= float(logp.double().sum())
        scored += end - first
        if on_window is not None:
            on_window(k, len(plan))
    seconds = time.perf_counter() - start
    return PerplexityResult(
        perplexity=math.exp(nll / scored),
        nll=nll,
        tokens=scored,
        windows=len(plan),
        context=context,
        stride=stride,
        seconds=seconds,
    )


@torch.no_grad()
def cached_nll(model: Any, ids: Tensor, cache: Any, *, chunk: int = 16) -> Tensor:
    """Per-token NLL of ``ids [1, T]`` decoded through ``cache``, ``chunk`` tokens a forward.

    Token ``t + 1`` is predicted by the query at ``t``, which attends to the keys the cache
    returns for the forward holding ``t``: its own chunk as written, and the earlier
    tokens as the cache keeps them (a quantized cache: stored levels beyond its float
    window). ``chunk=1`` is token-by-token decoding; a larger chunk is faster and, for a
    cache whose float window is at least ``chunk`` tokens, differs only in that a query
    early in its chunk sees the window ending at the chunk's end.

    Returns:
        ``[T - 1]`` float64: the NLL (nats) of tokens ``1 .. T-1``.
    """
    check_int("chunk", chunk, min_value=1)
    n = ids.shape[1] - 1
    out = torch.empty(n, dtype=torch.float64)
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        logits = model(ids[:, s:e], past_key_values=cache, use_cache=True).logits[0]
        logp = torch.log_softmax(logits.double(), dim=-1)  # [e - s, V]
        out[s:e] = -logp.gather(-1, ids[0, s + 1 : e + 1, None])[:, 0]
    return out
