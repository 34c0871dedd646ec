"""Statistics of attention weights, per layer and head.

Shape notation: ``H`` heads, ``L`` queries, ``S`` keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["HeadSummary", "diagonal_share", "entropy", "summarize_heads"]


def entropy(weights: Tensor) -> Tensor:
    """Shannon entropy (nats) of each attention row: ``[.., L, S] -> [.., L]``; 0·log 0 = 0."""
    w = weights.double()
    return -(w * torch.where(w > 0, w.log(), torch.zeros_like(w))).sum(-1).to(weights.dtype)


def diagonal_share(weights: Tensor) -> float:
    """Mean weight a query puts on its own position (square ``[.., L, L]`` weights)."""
    if weights.shape[-1] != weights.shape[-2]:
        raise ValueError(f"diagonal_share needs square weights, got {tuple(weights.shape)}")
    return float(weights.diagonal(dim1=-2, dim2=-1).float().mean())


@dataclass
class HeadSummary:
    """What one head does on one input.

    Attributes:
        layer: layer index.
        head: head index.
        targets: for each query token, the token it attends to most.
        max_weights: that largest weight, per query token.
        mean_entropy: mean row entropy in nats (0 = one-hot, log S = uniform).
    """

    layer: int
    head: int
    targets: list[str]
    max_weights: list[float]
    mean_entropy: float


def summarize_heads(weights: Tensor, tokens: list[str], layer: int = 0) -> list[HeadSummary]:
    """Summarise each head of one layer's weights ``[H, L, L]`` for one sequence.

    Raises:
        ValueError: weights that are not ``[H, L, L]`` with ``L == len(tokens)``.
    """
    if weights.dim() != 3 or weights.shape[-1] != len(tokens) or weights.shape[-2] != len(tokens):
        raise ValueError(
            f"weights must be [heads, {len(tokens)}, {len(tokens)}] for {len(tokens)} tokens, "
            f"got {tuple(weights.shape)}"
        )
    best, idx = weights.float().max(dim=-1)  # [H, L]
    ent = entropy(weights.float()).mean(-1)  # [H]
    return [
        HeadSummary(
            layer=layer,
            head=h,
            targets=[tokens[j] for j in idx[h].tolist()],
            max_weights=best[h].tolist(),
            mean_entropy=float(ent[h]),
        )
        for h in range(weights.shape[0])
    ]
