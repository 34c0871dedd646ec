"""Attention heatmaps as PNG files, drawn with matplotlib's object API (no pyplot state).

Shape notation: ``H`` heads, ``L`` queries, ``S`` keys.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from torch import Tensor

from attnlab._files import atomic_write

__all__ = ["heads_grid_figure", "heatmap_figure", "save_png"]


def _require_matplotlib() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("pictures need matplotlib: pip install 'attnlab[viz]'") from e
    return Figure


def _check(weights: Tensor, rows: list[str], cols: list[str]) -> None:
    if weights.dim() != 2 or tuple(weights.shape) != (len(rows), len(cols)):
        raise ValueError(
            f"weights must be [{len(rows)}, {len(cols)}] for the given tokens, got {tuple(weights.shape)}"
        )


def _draw(
    ax: Any,
    weights: Tensor,
    rows: list[str],
    cols: list[str],
    annotate: bool,
    value_range: tuple[float, float] | None = None,
) -> Any:
    w = weights.detach().float().cpu().numpy()
    lo, hi = value_range if value_range is not None else (0.0, max(float(w.max()), 1e-9))
    im = ax.imshow(w, cmap="viridis", vmin=lo, vmax=hi, aspect="auto")
    ax.set_xticks(range(len(cols)), cols, rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    if annotate:
        for i in range(w.shape[0]):
            for j in range(w.shape[1]):
                color = "black" if w[i, j] > lo + 0.6 * (hi - lo) else "white"
                ax.text(j, i, f"{w[i, j]:.2f}", ha="center", va="center", fontsize=7, color=color)
    return im


def heatmap_figure(
    weights: Tensor,
    tokens: list[str],
    *,
    key_tokens: list[str] | None = None,
    title: str = "",
    annotate: bool | None = None,
    axis_labels: tuple[str, str] = ("query", "key (attended to)"),
    value_range: tuple[float, float] | None = None,
    value_label: str = "attention weight",
) -> Any:
    """One attention map ``[L, S]``: queries down, keys across, like the tutorial's plot;
    or any other matrix over two lists of labels (a similarity matrix: pass its axis
    labels, its value range and what its values are).

    Args:
        weights: ``[L, S]`` attention weights (or another matrix).
        tokens: the ``L`` row labels (query tokens), shown whole.
        key_tokens: the ``S`` column labels (default ``tokens``).
        title: figure title.
        annotate: write each weight in its cell (default: when ``L, S <= 16``).
        axis_labels: ``(rows, columns)`` axis titles.
        value_range: the colour scale's ``(min, max)`` (default 0 to the largest value:
            attention weights are >= 0; a cosine similarity needs ``(-1, 1)``).
        value_label: the colour bar's title.

    Returns:
        A ``matplotlib.figure.Figure``.
    """
    Figure = _require_matplotlib()
    cols = tokens if key_tokens is None else key_tokens
    _check(weights, tokens, cols)
    annotate = max(len(tokens), len(cols)) <= 16 if annotate is None else annotate
    size = 1.5 + 0.45 * max(len(tokens), len(cols))
    longest = max((len(t) for t in [*tokens, *cols]), default=0)
    margin = 0.07 * longest  # inches for whole labels (constrained layout places them)
    fig = Figure(figsize=(size + 1.2 + margin, size + margin), layout="constrained")
    ax = fig.add_subplot()
    im = _draw(ax, weights, tokens, cols, annotate, value_range)
    ax.set_ylabel(axis_labels[0])
    ax.set_xlabel(axis_labels[1])
    if title:
        ax.set_title(title)
    fig.colorbar(im, ax=ax, shrink=0.8, label=value_label)
    return fig


def heads_grid_figure(
    weights: Tensor, tokens: list[str], *, title: str = "", cols: int = 4, label: str = "head"
) -> Any:
    """Every head of one layer, ``[H, L, L]``, in a grid of heatmaps titled ``f"{label} {i}"``."""
    Figure = _require_matplotlib()
    if weights.dim() != 3:
        raise ValueError(f"weights must be [heads, L, L], got {tuple(weights.shape)}")
    n = weights.shape[0]
    cols = min(cols, n)
    rows = math.ceil(n / cols)
    cell = 1.0 + 0.32 * len(tokens)
    fig = Figure(figsize=(cols * cell, rows * cell + 0.6), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for h in range(rows * cols):
        ax = axes[h // cols][h % cols]
        if h >= n:
            ax.axis("off")
            continue
        _check(weights[h], tokens, tokens)
        _draw(ax, weights[h], tokens, tokens, annotate=False)
        ax.set_title(f"{label} {h}", fontsize=9)
        # token labels on the outer axes only: the grid shares them, and laying out
        # 12 x 2 x L labels was a third of `attnlab visualize`'s time
        last_row = h + cols >= n
        ax.tick_params(labelleft=h % cols == 0, labelbottom=last_row)
    if title:
        fig.suptitle(title)
    return fig


def save_png(fig: Any, path: str | Path, dpi: int = 110) -> Path:
    """Write ``fig`` to ``path`` as PNG (creating the folder, atomically) and return the path.

    zlib level 1: the default level 6 spent about a quarter of ``attnlab visualize``'s time
    compressing, for files about a third smaller.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(
        path, lambda tmp: fig.savefig(tmp, dpi=dpi, format="png", pil_kwargs={"compress_level": 1})
    )
    return path
