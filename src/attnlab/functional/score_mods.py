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
* :func:`symmetric_alibi`: ALiBi by absolute distance ``|kv_idx - q_idx|``, for
  bidirectional encoders.
* :func:`softcap`: logit soft-capping ``cap * tanh(s / cap)`` (Bello et al., 2016,
  "Neural combinatorial optimization with reinforcement learning"; used by Gemma 2).
* :func:`t5_bias`: T5's learned relative-position bias, one scalar per (bucket, head)
  looked up from the distance ``kv_idx - q_idx`` (Raffel et al., 2020, "Exploring the
  limits of transfer learning with a unified text-to-text transformer", sec. 2.1).

The indices are positions (slots), not array indices: a backend passes the call's
``q_positions``/``k_positions`` (see ``docs/contracts.md``), so a bias by distance is
right in cached decoding and for rows of different lengths. ALiBi on slots equals
BLOOM's ALiBi on ``cumsum(mask) - 1`` positions: the two differ by a constant per
query row, which the softmax cancels.

Each modifier also gives its derivative with respect to the score, and a learned one
the gradient of its parameters (:meth:`ScoreMod.parameter_grads`), which the
``tiled`` backend's hand-written backward needs (:func:`score_mods_backward`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from attnlab.functional._checks import check_positive_int, check_real
from attnlab.functional.positions import alibi_slopes, t5_relative_position_bucket

__all__ = [
    "ALiBi",
    "ScoreMod",
    "SoftCap",
    "SymmetricALiBi",
    "T5Bias",
    "alibi",
    "alibi_slopes",
    "apply_score_mods",
    "score_mods_backward",
    "softcap",
    "symmetric_alibi",
    "t5_bias",
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

    def parameters(self) -> tuple[Tensor, ...]:
        """Learned tensors the modifier reads (a T5 bias table); empty for fixed ones."""
        return ()

    def parameter_grads(
        self, grad: Tensor, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> tuple[Tensor, ...]:
        """Gradients of ``sum(grad * self(score, ...))`` w.r.t. :meth:`parameters`, in order."""
        return ()


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


class SymmetricALiBi(ALiBi):
    """``score - slope[h] * |kv_idx - q_idx|``: ALiBi for bidirectional encoders.

    Press et al., 2022 define ALiBi for causal models, where ``kv_idx <= q_idx``; encoders
    that use it (e.g. MosaicBERT, Portes et al., 2023) penalise the distance on both sides.
    """

    def __call__(
        self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> Tensor:
        slope = self.slopes.to(device=score.device, dtype=score.dtype)[h]
        return score - slope * (kv_idx - q_idx).abs().to(score.dtype)

    def __repr__(self) -> str:
        return f"symmetric_alibi({self.slopes.numel()} heads)"


class SoftCap(ScoreMod):
    """``cap * tanh(score / cap)``: scores bounded to ``(-cap, cap)``."""

    def __init__(self, cap: float) -> None:
        self.cap = check_real("the soft cap", cap, gt=0.0)

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


class T5Bias(ScoreMod):
    """``score + table[bucket(kv_idx - q_idx), h]``: T5's learned relative-position bias.

    ``table`` is ``[num_buckets, H]`` (the weight of T5's ``relative_attention_bias``
    embedding), held by reference: a learned parameter receives its gradient through
    autograd on ``reference`` and ``sparse``, and through :meth:`parameter_grads` on
    ``tiled``, whose backward is written by hand.
    """

    additive = True

    def __init__(self, table: Tensor, *, bidirectional: bool, max_distance: int) -> None:
        if not isinstance(table, Tensor) or table.dim() != 2 or not table.is_floating_point():
            raise ValueError(
                "the T5 bias table must be a floating tensor [num_buckets, num_heads], got "
                f"{type(table).__name__} {tuple(getattr(table, 'shape', ()))}"
            )
        check_positive_int("max_distance", max_distance)
        self.table = table
        self.bidirectional = bool(bidirectional)
        self.max_distance = max_distance

    def _flat_index(self, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        bucket = t5_relative_position_bucket(
            kv_idx - q_idx,
            bidirectional=self.bidirectional,
            num_buckets=self.table.shape[0],
            max_distance=self.max_distance,
        )
        return bucket * self.table.shape[1] + h  # index into table.view(-1)

    def __call__(
        self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> Tensor:
        table = self.table.to(device=score.device, dtype=score.dtype)
        return score + table.view(-1)[self._flat_index(h, q_idx, kv_idx)]

    def check_heads(self, num_heads: int) -> None:
        if self.table.shape[1] != num_heads:
            raise ValueError(
                f"the T5 bias table has {self.table.shape[1]} heads but the query has {num_heads}"
            )

    def parameters(self) -> tuple[Tensor, ...]:
        return (self.table,)

    def parameter_grads(
        self, grad: Tensor, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> tuple[Tensor, ...]:
        idx = self._flat_index(h, q_idx, kv_idx).expand(grad.shape)
        g = torch.zeros(self.table.numel(), dtype=grad.dtype, device=grad.device)
        g.index_add_(0, idx.reshape(-1), grad.reshape(-1))
        return (g.view(self.table.shape).to(self.table.dtype),)

    def __repr__(self) -> str:
        n, heads = self.table.shape
        return (
            f"t5_bias({n} buckets, {heads} heads, bidirectional={self.bidirectional}, "
            f"max_distance={self.max_distance})"
        )


def alibi(slopes: Sequence[float] | Tensor | int) -> ALiBi:
    """ALiBi bias; ``slopes`` is one slope per query head, or a head count for the paper's slopes."""
    if isinstance(slopes, bool):
        raise TypeError("alibi takes slopes or a head count, got a bool")
    if isinstance(slopes, int):
        return ALiBi(alibi_slopes(slopes))
    return ALiBi(slopes)


def symmetric_alibi(num_heads: int) -> SymmetricALiBi:
    """Two-sided ALiBi with the paper's slopes for ``num_heads`` heads (encoders)."""
    return SymmetricALiBi(alibi_slopes(num_heads))


def softcap(cap: float) -> SoftCap:
    """Logit soft-capping at ``cap`` (Gemma 2 uses 50 for attention)."""
    return SoftCap(cap)


def t5_bias(table: Tensor, *, bidirectional: bool = True, max_distance: int = 128) -> T5Bias:
    """T5's relative-position bias from its ``[num_buckets, num_heads]`` table.

    ``bidirectional=True`` for the encoder, ``False`` for causal decoder self-attention.
    """
    return T5Bias(table, bidirectional=bidirectional, max_distance=max_distance)


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


def score_mods_backward(
    mods: Sequence[ScoreMod],
    score: Tensor,
    b: Tensor,
    h: Tensor,
    q_idx: Tensor,
    kv_idx: Tensor,
    grad: Tensor,
) -> tuple[Tensor, list[Tensor]]:
    """Back-propagate ``grad`` (d loss / d modified score) through ``mods``.

    Recomputes each modifier's input from ``score`` (the unmodified scaled score).

    Returns:
        ``(d loss / d score, [gradient of each parameter of each modifier, in order])``.
    """
    inputs: list[Tensor] = []
    x = score
    for m in mods:
        inputs.append(x)
        x = m(x, b, h, q_idx, kv_idx)
    grads: list[list[Tensor]] = []
    for m, x in zip(reversed(mods), reversed(inputs), strict=True):
        grads.append(list(m.parameter_grads(grad, x, b, h, q_idx, kv_idx)))
        if not m.additive:
            grad = grad * m.derivative(x, b, h, q_idx, kv_idx)
    return grad, [g for per_mod in reversed(grads) for g in per_mod]
