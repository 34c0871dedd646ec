"""Score modifiers: functions of a score and its position, applied before the softmax.

A score modifier changes ``s = q . k * scale`` of the pair (query ``q_idx``, key
``kv_idx``) in head ``h`` of sequence ``b`` before the mask and the softmax, as
FlexAttention's ``score_mod`` does. Backends that understand them apply them on
the fly, tile by tile, without an ``L x S`` bias tensor. They reach a backend
attached to a mask pattern: ``masks.causal().with_scores(alibi(slopes))``.

* :func:`alibi`: ALiBi, a linear bias by distance per head, with the slopes of
  :func:`attnlab.functional.positions.alibi_slopes` (Press et al., 2022,
  "Train short, test long: attention with linear biases enables input length
  extrapolation").
* :func:`softcap`: logit soft-capping ``cap * tanh(s / cap)`` (Bello et al., 2016,
  "Neural combinatorial optimization with reinforcement learning"; used by Gemma 2).

Each modifier also gives its derivative with respect to the score, which the
``tiled`` backend's hand-written backward needs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from attnlab.functional.positions import alibi_slopes

__all__ = [
    "ALiBi",
    "ScoreMod",
    "SoftCap",
    "SymmetricALiBi",
    "alibi",
    "alibi_slopes",
    "softcap",
    "symmetric_alibi",
]


class ScoreMod:
    """A score modifier ``(score, b, h, q_idx, kv_idx) -> score`` on broadcastable tensors."""

    #: True when the modifier adds a term independent of the score (derivative 1).
    additive: bool = False

    def __call__(
        self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> Tensor:
        raise NotImplementedError

    def derivative(
        self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> Tensor:
        """``d modified / d score`` at ``score`` (the input of this modifier)."""
        return torch.ones_like(score)

    def check_heads(self, num_heads: int) -> None:
        """Raise ``ValueError`` if the modifier does not fit ``num_heads`` query heads."""


class ALiBi(ScoreMod):
    """``score + slope[h] * (kv_idx - q_idx)``: farther keys get a lower score."""

    additive = True

    def __init__(self, slopes: Sequence[float] | Tensor) -> None:
        s = torch.as_tensor(slopes, dtype=torch.float64).flatten()
        if s.numel() == 0:
            raise ValueError("ALiBi needs one slope per head, got none")
        self.slopes = s

    def __call__(
        self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> Tensor:
        slope = self.slopes.to(device=score.device, dtype=score.dtype)[h]
        return score + slope * (kv_idx - q_idx).to(score.dtype)

    def check_heads(self, num_heads: int) -> None:
        if self.slopes.numel() != num_heads:
            raise ValueError(
                f"ALiBi has {self.slopes.numel()} slopes but the query has {num_heads} heads"
            )

    def __repr__(self) -> str:
        return f"alibi({self.slopes.numel()} heads)"


class SoftCap(ScoreMod):
    """``cap * tanh(score / cap)``: scores bounded to ``(-cap, cap)``."""

    def __init__(self, cap: float) -> None:
        if isinstance(cap, bool) or not isinstance(cap, int | float) or not cap > 0:
            raise ValueError(f"the soft cap must be a positive number, got {cap!r}")
        self.cap = float(cap)

    def __call__(
        self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> Tensor:
        return self.cap * torch.tanh(score / self.cap)

    def derivative(
        self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> Tensor:
        t = torch.tanh(score / self.cap)
        return 1.0 - t * t

    def __repr__(self) -> str:
        return f"softcap({self.cap:g})"


def alibi(slopes: Sequence[float] | Tensor | int) -> ALiBi:
    """ALiBi bias; ``slopes`` is one slope per query head, or a head count for the paper's slopes."""
    if isinstance(slopes, bool):
        raise TypeError("alibi takes slopes or a head count, got a bool")
    if isinstance(slopes, int):
        return ALiBi(alibi_slopes(slopes))
    return ALiBi(slopes)


def softcap(cap: float) -> SoftCap:
    """Logit soft-capping at ``cap`` (Gemma 2 uses 50 for attention)."""
    return SoftCap(cap)


def apply_score_mods(
    mods: Sequence[ScoreMod], score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
) -> tuple[Tensor, Tensor | None]:
    """Apply ``mods`` in order; return the modified score and ``d modified / d score``.

    The derivative is None when every modifier is additive (it is then 1).
    """
    deriv: Tensor | None = None
    for m in mods:
        if not m.additive:
            d = m.derivative(score, b, h, q_idx, kv_idx)
            deriv = d if deriv is None else deriv * d
        score = m(score, b, h, q_idx, kv_idx)
    return score, deriv


class SymmetricALiBi(ScoreMod):
    """``score - slope[h] * |kv_idx - q_idx|``: ALiBi for bidirectional encoders.

    Press et al., 2022 define ALiBi for causal models, where ``kv_idx <= q_idx``; encoders
    that use it (e.g. MosaicBERT) penalise the distance on both sides.
    """

    additive = True

    def __init__(self, slopes: Sequence[float] | Tensor) -> None:
        s = torch.as_tensor(slopes, dtype=torch.float64).flatten()
        if s.numel() == 0:
            raise ValueError("ALiBi needs one slope per head, got none")
        self.slopes = s

    def __call__(
        self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> Tensor:
        slope = self.slopes.to(device=score.device, dtype=score.dtype)[h]
        return score - slope * (kv_idx - q_idx).abs().to(score.dtype)

    def check_heads(self, num_heads: int) -> None:
        if self.slopes.numel() != num_heads:
            raise ValueError(
                f"ALiBi has {self.slopes.numel()} slopes but the query has {num_heads} heads"
            )

    def __repr__(self) -> str:
        return f"symmetric_alibi({self.slopes.numel()} heads)"


def symmetric_alibi(num_heads: int) -> SymmetricALiBi:
    """Two-sided ALiBi with the paper's slopes for ``num_heads`` heads (encoders)."""
    return SymmetricALiBi(alibi_slopes(num_heads))
