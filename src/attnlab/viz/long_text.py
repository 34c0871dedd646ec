"""A real decoder's attention over a long text, shrunk so that the sink columns stay visible.

Shape notation: ``H`` heads, ``L`` tokens, ``R`` query bins, ``C`` key columns.

The explorer embeds every weight (at most :data:`attnlab.viz.explorer.MAX_TOKENS` tokens).
Over a long text this page keeps the first ``sinks`` keys as one column each, sums the
other keys in equal bins (so each row still sums to 1 and a bin's shade is the share of
attention it gets) and averages the queries in equal bins. In a trained decoder the sink
columns stay dark however long the text: the attention sinks of Xiao et al., 2023
("Efficient Streaming Language Models with Attention Sinks"), the reason a streaming
cache keeps the first tokens (:class:`attnlab.cache.SinkKVCache`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

from attnlab._validate import check_int
from attnlab.viz.explorer import explorer_html

__all__ = ["long_text_html", "pool_attention"]


def _edges(start: int, stop: int, bins: int) -> list[tuple[int, int]]:
    n = stop - start
    bins = max(1, min(bins, n))
    cuts = [start + (n * i) // bins for i in range(bins + 1)]
    return [(a, b) for a, b in itertools.pairwise(cuts) if b > a]


def pool_attention(
    weights: Tensor, *, sinks: int = 4, columns: int = 40, rows: int = 40
) -> tuple[Tensor, list[tuple[int, int]], list[tuple[int, int]]]:
    """Shrink one layer's ``[H, L, L]`` (or ``[1, H, L, L]``) weights for a long text.

    Args:
        weights: attention weights, each query row summing to 1.
        sinks: the first keys kept as a column each.
        columns: bins the other keys are summed into.
        rows: bins the queries are averaged over.

    Returns:
        ``(pooled [H, R, C], query spans, key spans)``, each span ``(first, end)`` of
        token indices; the first ``min(sinks, L)`` key spans are single tokens.

    Raises:
        ValueError: bad counts, or weights that are not square ``[H, L, L]``.
    """
    sinks = check_int("sinks", sinks, min_value=0)
    columns = check_int("columns", columns, min_value=1)
    rows = check_int("rows", rows, min_value=1)
    w = weights[0] if weights.dim() == 4 and weights.shape[0] == 1 else weights
    if w.dim() != 3 or w.shape[-1] != w.shape[-2]:
        raise ValueError(f"weights must be [H, L, L] of one sequence, got {tuple(weights.shape)}")
    n = w.shape[-1]
    s = min(sinks, n)
    keys = [(j, j + 1) for j in range(s)] + (_edges(s, n, columns) if n > s else [])
    queries = _edges(0, n, rows)
    w = w.float()
    col = torch.stack([w[..., a:b].sum(-1) for a, b in keys], dim=-1)  # [H, L, C]
    pooled = torch.stack([col[:, a:b].mean(1) for a, b in queries], dim=1)  # [H, R, C]
    return pooled, queries, keys


def _label(tokens: Sequence[str], span: tuple[int, int]) -> str:
    a, b = span
    return f"{a}:{tokens[a]}" if b == a + 1 else f"{a}-{b - 1}"


def long_text_html(
    attentions: Sequence[Tensor],
    tokens: Sequence[str],
    *,
    sinks: int = 4,
    columns: int = 40,
    rows: int = 40,
    title: str = "attention over a long text",
    subtitle: str = "",
) -> str:
    """The explorer page (:func:`attnlab.viz.explorer.explorer_html`) of
    :func:`pool_attention` applied to every layer: the first ``sinks`` keys one column each
    (labelled ``index:token``), the rest and the queries in spans (``first-last``)."""
    if len(attentions) == 0:
        raise ValueError("attentions is empty: pass one [H, L, L] tensor per layer")
    pooled = []
    queries: list[tuple[int, int]] = []
    keys: list[tuple[int, int]] = []
    for w in attentions:
        p, queries, keys = pool_attention(w, sinks=sinks, columns=columns, rows=rows)
        pooled.append(p)
    n = keys[-1][1]
    if len(tokens) != n:
        raise ValueError(f"weights cover {n} tokens but {len(tokens)} tokens were given")
    return explorer_html(
        pooled,
        [_label(tokens, q) for q in queries],
        key_tokens=[_label(tokens, k) for k in keys],
        title=title,
        subtitle=subtitle,
    )
