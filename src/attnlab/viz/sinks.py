"""Attention sinks: the share of attention each layer puts on the first token, as a line plot.

Xiao et al., 2023 ("Efficient streaming language models with attention sinks") found
that trained decoders park much of their attention on the first token in most layers
beyond the first few; this draws that share per layer (mean over heads and queries,
with the range over heads).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from attnlab.viz.heatmap import _require_matplotlib

__all__ = ["first_token_shares", "sink_figure"]


def first_token_shares(attentions: Sequence[Tensor]) -> Tensor:
    """``[layers, heads]`` mean weight on key 0, over the queries after the first.

    Args:
        attentions: per layer, ``[H, L, L]`` (or ``[1, H, L, L]``) causal weights, ``L >= 2``.

    Raises:
        ValueError: no layers, or fewer than two tokens (query 0 can only see key 0).
    """
    import torch

    if not attentions:
        raise ValueError("no attention weights")
    rows = []
    for w in attentions:
        w = w[0] if w.dim() == 4 else w
        if w.shape[-2] < 2:
            raise ValueError(f"first-token share needs at least 2 tokens, got {w.shape[-2]}")
        rows.append(w[:, 1:, 0].float().mean(-1))  # [H]
    return torch.stack(rows)


def sink_figure(shares: Tensor, *, title: str = "") -> Any:
    """A line plot of ``shares`` (``[layers, heads]``): mean over heads, with the heads' range."""
    Figure = _require_matplotlib()
    layers = list(range(shares.shape[0]))
    fig = Figure(figsize=(7, 3.6), layout="constrained")
    ax = fig.subplots()
    ax.fill_between(
        layers,
        shares.min(1).values.tolist(),
        shares.max(1).values.tolist(),
        alpha=0.25,
        label="range over heads",
    )
    ax.plot(layers, shares.mean(1).tolist(), marker="o", label="mean over heads")
    ax.set_xlabel("layer")
    ax.set_ylabel("attention on the first token")
    ax.set_ylim(0, 1)
    ax.legend(loc="best")
    ax.set_title(title or "attention sinks: share of attention on the first token")
    return fig
