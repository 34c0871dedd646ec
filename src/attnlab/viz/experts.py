"""A picture of expert load per MoE layer (matplotlib's object API, the ``viz`` extra)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from attnlab.viz.heatmap import _require_matplotlib

__all__ = ["expert_load_figure"]


def expert_load_figure(loads: Sequence[Any], *, title: str = "") -> Any:
    """A MoE layers x experts heatmap of the share of tokens choosing each expert.

    A balanced top-``k`` router of ``E`` experts gives every cell about ``k / E``; a
    collapsed layer (flagged by :func:`~attnlab.analysis.expert_stats.expert_load`) shows
    one bright column and is marked on its row label.

    Args:
        loads: :class:`~attnlab.analysis.expert_stats.ExpertLoad` per MoE layer
            (``DiagnosisReport.experts``).
        title: figure title.

    Raises:
        ValueError: no loads.
    """
    if not loads:
        raise ValueError("no expert loads to draw (the model has no MoE layers?)")
    Figure = _require_matplotlib()
    n_experts = max(len(x.tokens_per_expert) for x in loads)
    grid = [
        [c / x.tokens if x.tokens else float("nan") for c in x.tokens_per_expert]
        + [float("nan")] * (n_experts - len(x.tokens_per_expert))
        for x in loads
    ]
    fig = Figure(figsize=(1.8 + 0.55 * n_experts, 1.0 + 0.45 * len(loads)), layout="constrained")
    ax = fig.add_subplot()
    im = ax.imshow(grid, cmap="viridis", aspect="auto", vmin=0.0, vmax=1.0)
    ax.set_xticks(range(n_experts), [str(i) for i in range(n_experts)], fontsize=8)
    labels = [f"{x.layer}{' (collapsed)' if x.collapsed else ''}" for x in loads]
    ax.set_yticks(range(len(loads)), labels, fontsize=8)
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v == v:
                ax.text(
                    j,
                    i,
                    f"{v:.2f}",
                    ha="center",
                    va="center",
                    fontsize=6.5,
                    color="white" if v < 0.5 else "black",
                )
    ax.set_title(title or "share of tokens choosing each expert", fontsize=10)
    fig.colorbar(im, ax=ax, shrink=0.85)
    return fig
