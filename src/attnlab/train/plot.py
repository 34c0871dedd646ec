"""The loss curve of a run, as a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_history"]


def plot_history(history: list[dict[str, Any]], path: Path) -> Path:
    """Training loss per step and held-out loss where it was measured.

    Raises:
        ImportError: matplotlib is missing (the ``viz`` extra).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in history if "loss" in r]
    held = [(r["step"], r["eval_loss"]) for r in history if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if held:
        ax.plot(*zip(*held), "o-", label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
