"""Plots of attention statistics and of cost (matplotlib's object API, the ``viz`` extra).

* :func:`head_stat_figure`: a layer x head grid of one statistic (entropy, attention
  distance, first-token share...) from :func:`attnlab.analysis.diagnose.attention_head_stats`;
* :func:`cost_vs_length_figure`: FLOPs and memory against sequence length, log-log, from
  :func:`attnlab.analysis.scaling.scaling_table`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from attnlab.viz.heatmap import _require_matplotlib

__all__ = ["cost_vs_length_figure", "head_stat_figure"]

_LABELS = {
    "entropy": "mean entropy (nats)",
    "mean_distance": "mean attention distance (tokens)",
    "first_token_share": "share of attention on the first token",
    "max_weight": "mean largest weight",
    "row_sum_error": "max |row sum - 1|",
}


def head_stat_figure(heads: Sequence[Any], stat: str = "entropy", *, title: str = "") -> Any:
    """A layers x heads heatmap of one statistic, each cell annotated.

    Args:
        heads: :class:`~attnlab.analysis.diagnose.HeadStats` for every layer and head.
        stat: the attribute to draw: ``entropy``, ``mean_distance``, ``first_token_share``,
            ``max_weight`` or ``row_sum_error``.
        title: figure title (default: the statistic's name).

    Raises:
        ValueError: no statistics, or an unknown ``stat``.
    """
    if not heads:
        raise ValueError("no head statistics to draw")
    if stat not in _LABELS:
        raise ValueError(f"unknown statistic {stat!r}; known: {sorted(_LABELS)}")
    Figure = _require_matplotlib()
    n_layers = max(h.layer for h in heads) + 1
    n_heads = max(h.head for h in heads) + 1
    grid = [[float("nan")] * n_heads for _ in range(n_layers)]
    for h in heads:
        grid[h.layer][h.head] = float(getattr(h, stat))
    fig = Figure(figsize=(1.2 + 0.55 * n_heads, 1.0 + 0.45 * n_layers), layout="constrained")
    ax = fig.add_subplot()
    im = ax.imshow(grid, cmap="magma", aspect="auto")
    ax.set_xticks(range(n_heads), [str(i) for i in range(n_heads)], fontsize=8)
    ax.set_yticks(range(n_layers), [str(i) for i in range(n_layers)], fontsize=8)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    flat = [v for row in grid for v in row if v == v]
    hi, lo = max(flat), min(flat)
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v == v:
                light = v < lo + 0.55 * (hi - lo)
                ax.text(
                    j,
                    i,
                    f"{v:.2f}",
                    ha="center",
                    va="center",
                    fontsize=6.5,
                    color="white" if light else "black",
                )
    ax.set_title(title or _LABELS[stat], fontsize=10)
    fig.colorbar(im, ax=ax, shrink=0.85)
    return fig


def cost_vs_length_figure(rows: Sequence[Any], *, title: str = "") -> Any:
    """FLOPs (left) and memory (right) against sequence length, one line per variant.

    Args:
        rows: :class:`~attnlab.analysis.scaling.ScalingRow` objects.
        title: figure title.

    Raises:
        ValueError: no rows.
    """
    if not rows:
        raise ValueError("no rows to draw")
    Figure = _require_matplotlib()
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ax_f, ax_m = fig.subplots(1, 2)
    variants = list(dict.fromkeys(r.variant for r in rows))
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]
    for k, v in enumerate(variants):
        rs = [r for r in rows if r.variant == v]
        n = [r.seq_len for r in rs]
        c = colors[k % len(colors)]
        ax_f.plot(
            n,
            [r.attention_flops_per_layer for r in rs],
            "-o",
            ms=3,
            color=c,
            label=f"{v}: attention / layer",
        )
        ax_f.plot(n, [r.forward_flops for r in rs], "--", color=c, label=f"{v}: model forward")
        ax_m.plot(
            n,
            [r.training_activations_tiled for r in rs],
            "-o",
            ms=3,
            color=c,
            label=f"{v}: training activations (tiled)",
        )
        ax_m.plot(n, [r.kv_cache_bytes for r in rs], ":", color=c, label=f"{v}: KV cache (fp16)")
    dense = [r for r in rows if r.variant == variants[0]]
    ax_f.plot(
        [r.seq_len for r in dense],
        [r.tutorial_n2d for r in dense],
        color="gray",
        lw=1,
        label="tutorial n²·d",
    )
    ax_m.plot(
        [r.seq_len for r in dense],
        [r.score_matrix_bytes for r in dense],
        color="gray",
        lw=1,
        label="one layer's score matrix (fp32)",
    )
    for ax, label in ((ax_f, "FLOPs"), (ax_m, "bytes")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel(label)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7)
    ax_f.set_title("work", fontsize=10)
    ax_m.set_title("memory", fontsize=10)
    if title:
        fig.suptitle(title)
    return fig
