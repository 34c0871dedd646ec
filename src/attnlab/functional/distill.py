"""Knowledge-distillation losses: logits, hidden states, attention distributions.

Shape notation: ``B`` batch, ``L`` tokens, ``V`` classes or vocabulary, ``D`` width,
``H`` heads, ``S`` keys, ``E`` head dim.

* :func:`kl_div_logits`: the soft-target loss of Hinton et al. (2015, "Distilling the
  Knowledge in a Neural Network"): ``T² · KL(p_teacher^T || p_student^T)`` (forward KL,
  mean-seeking) or ``T² · KL(p_student^T || p_teacher^T)`` (reverse KL, mode-seeking, as
  MiniLLM uses for generative models; Gu et al., 2024). The ``T²`` keeps gradient sizes
  comparable across temperatures.
* :func:`hidden_state_loss`: mean squared error between student and (optionally
  projected) teacher states (TinyBERT, Jiao et al., 2020).
* :func:`attention_kl`: MiniLM's self-attention distribution transfer (Wang et al.,
  2020, eq. 3): ``KL(A_teacher || A_student)`` per head and query, averaged.
* :func:`value_relation_kl`: MiniLM's value-relation transfer (eq. 4-5): the same KL on
  ``softmax(V Vᵀ / sqrt(E))``.
* :func:`similarity_relation_loss`: relational distillation on sentence embeddings: the
  mean squared difference of the in-batch cosine-similarity matrices (the angle-free
  "distance-wise" relation of Park et al., 2019, "Relational Knowledge Distillation",
  taken on cosines, which is what a sentence encoder is scored on).

All reductions skip masked positions (``mask`` of 1/0 or bool over tokens); the math runs in
float32 for 16-bit inputs.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.functional._checks import check_real

__all__ = [
    "attention_kl",
    "hidden_state_loss",
    "kl_div_logits",
    "similarity_relation_loss",
    "value_relation_kl",
]

Direction = Literal["forward", "reverse"]


def _check_pair(name: str, student: Tensor, teacher: Tensor) -> None:
    if not isinstance(student, Tensor) or not isinstance(teacher, Tensor):
        raise TypeError(f"{name}: student and teacher must be tensors")
    if student.shape != teacher.shape:
        raise ValueError(
            f"{name}: student {tuple(student.shape)} and teacher {tuple(teacher.shape)} "
            "must have the same shape"
        )


def _token_weights(mask: Tensor | None, shape: torch.Size, device: torch.device) -> Tensor | None:
    """``mask`` ``[B, L]`` as float weights, or None (every token counts)."""
    if mask is None:
        return None
    if mask.shape != shape:
        raise ValueError(f"mask must have shape {tuple(shape)}, got {tuple(mask.shape)}")
    if mask.dtype != torch.bool and bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("mask must hold only 0/1 (or bool)")
    w = mask.to(device=device, dtype=torch.float32)
    if not bool(w.any()):
        raise ValueError("mask selects no token")
    return w


def _acc(x: Tensor) -> Tensor:
    """``x`` in float32 when it is 16-bit, as it is otherwise (float64 stays float64)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _masked_mean(per_token: Tensor, weights: Tensor | None) -> Tensor:
    if weights is None:
        return per_token.mean()
    return (per_token * weights.to(per_token.dtype)).sum() / weights.sum()


def kl_div_logits(
    student_logits: Tensor,
    teacher_logits: Tensor,
    *,
    temperature: float = 1.0,
    direction: Direction = "forward",
    mask: Tensor | None = None,
) -> Tensor:
    """Soft-target distillation loss on logits ``[..., V]``, averaged over positions.

    Args:
        student_logits, teacher_logits: ``[..., V]`` of the same shape.
        temperature: softens both distributions (Hinton et al., 2015); the loss is scaled
            by ``T²``.
        direction: ``"forward"`` ``KL(teacher || student)`` or ``"reverse"``
            ``KL(student || teacher)``.
        mask: 1/0 over the leading dims (e.g. ``[B, L]``): positions to average over.

    Returns:
        A scalar.

    Raises:
        ValueError: mismatched shapes, a temperature that is not positive and finite, an
            unknown direction, a malformed mask.
    """
    _check_pair("kl_div_logits", student_logits, teacher_logits)
    t = check_real("temperature", temperature, gt=0.0)
    if direction not in ("forward", "reverse"):
        raise ValueError(f"direction must be 'forward' or 'reverse', got {direction!r}")
    log_s = F.log_softmax(_acc(student_logits) / t, dim=-1)
    log_t = F.log_softmax(_acc(teacher_logits) / t, dim=-1)
    if direction == "forward":
        per = (log_t.exp() * (log_t - log_s)).sum(-1)
    else:
        per = (log_s.exp() * (log_s - log_t)).sum(-1)
    w = _token_weights(mask, per.shape, per.device)
    return _masked_mean(per, w) * t * t


def hidden_state_loss(
    student: Tensor,
    teacher: Tensor,
    *,
    projection: torch.nn.Module | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """Mean squared error between hidden states ``[B, L, D]`` (TinyBERT's hidden loss).

    Args:
        student: ``[B, L, D_s]``.
        teacher: ``[B, L, D_t]``.
        projection: maps the student's width to the teacher's when they differ
            (a learned ``nn.Linear(D_s, D_t)``).
        mask: ``[B, L]`` 1/0: tokens to average over.
    """
    s = projection(student) if projection is not None else student
    _check_pair("hidden_state_loss", s, teacher)
    per = (_acc(s) - _acc(teacher)).pow(2).mean(-1)  # [B, L]
    w = _token_weights(mask, per.shape, per.device)
    return _masked_mean(per, w)


def _distribution_kl(
    teacher_probs: Tensor, student_probs: Tensor, key_mask: Tensor | None
) -> Tensor:
    """KL over the last dim of two ``[B, H, L, S]`` distributions; masked keys ignored."""
    tiny = torch.finfo(torch.float32).tiny
    t = _acc(teacher_probs)
    s = _acc(student_probs)
    per = t * (torch.log(t.clamp_min(tiny)) - torch.log(s.clamp_min(tiny)))
    if key_mask is not None:
        per = per * key_mask[:, None, None, :].to(per.dtype)
    return per.sum(-1)  # [B, H, L]


def attention_kl(
    student_weights: Tensor, teacher_weights: Tensor, *, mask: Tensor | None = None
) -> Tensor:
    """MiniLM's self-attention distribution transfer: ``KL(A_t || A_s)`` averaged.

    Args:
        student_weights, teacher_weights: attention probabilities ``[B, H, L, S]`` (rows
            sum to 1), the same number of heads (Wang et al., 2020, distil the last layer).
        mask: ``[B, S]`` 1/0 over tokens (queries and keys are the same tokens).

    Returns:
        A scalar: the mean over heads and real queries.
    """
    _check_pair("attention_kl", student_weights, teacher_weights)
    if student_weights.dim() != 4:
        raise ValueError(
            f"attention weights must be [B, H, L, S], got {tuple(student_weights.shape)}"
        )
    b, _, lq, s = student_weights.shape
    w = _token_weights(mask, torch.Size((b, s)), student_weights.device)
    per = _distribution_kl(teacher_weights, student_weights, w).mean(1)  # [B, L]
    if w is not None and lq != s:
        raise ValueError("a token mask needs self-attention weights (L == S)")
    return _masked_mean(per, w)


def value_relation_kl(
    student_values: Tensor, teacher_values: Tensor, *, mask: Tensor | None = None
) -> Tensor:
    """MiniLM's value-relation transfer: KL between ``softmax(V Vᵀ / sqrt(E))`` of each.

    Args:
        student_values: ``[B, H, L, E_s]``.
        teacher_values: ``[B, H, L, E_t]`` (same heads; head dims may differ, the
            relation is ``[B, H, L, L]`` either way).
        mask: ``[B, L]`` 1/0 over tokens.
    """
    if student_values.dim() != 4 or teacher_values.dim() != 4:
        raise ValueError("values must be [B, H, L, E]")
    if student_values.shape[:3] != teacher_values.shape[:3]:
        raise ValueError(
            f"values must agree on [B, H, L]: student {tuple(student_values.shape)}, "
            f"teacher {tuple(teacher_values.shape)}"
        )
    b, _, n, _ = student_values.shape
    w = _token_weights(mask, torch.Size((b, n)), student_values.device)

    def relation(v: Tensor) -> Tensor:
        v = _acc(v)
        scores = v @ v.transpose(-1, -2) / v.shape[-1] ** 0.5  # [B, H, L, L]
        if w is not None:
            scores = scores.masked_fill(w[:, None, None, :] == 0, float("-inf"))
        return scores.softmax(-1)

    per = _distribution_kl(relation(teacher_values), relation(student_values), w).mean(1)
    return _masked_mean(per, w)


def similarity_relation_loss(student: Tensor, teacher: Tensor) -> Tensor:
    """Mean squared difference of the pairwise cosine similarities within a batch.

    Matches what sentence embeddings are used for (ranking pairs by cosine) rather than the
    vectors themselves, so it also applies when the widths differ.

    Args:
        student: ``[B, D_s]`` sentence embeddings.
        teacher: ``[B, D_t]`` sentence embeddings of the same ``B`` sentences.

    Returns:
        A scalar: the mean over the ``B (B - 1)`` off-diagonal pairs.

    Raises:
        TypeError: a non-tensor input.
        ValueError: not ``[B, D]``, different batch sizes, or fewer than two rows.
    """
    if not isinstance(student, Tensor) or not isinstance(teacher, Tensor):
        raise TypeError("similarity_relation_loss: student and teacher must be tensors")
    if student.dim() != 2 or teacher.dim() != 2 or len(student) != len(teacher):
        raise ValueError(
            "similarity_relation_loss: embeddings must be [B, D] with the same B, got "
            f"student {tuple(student.shape)} and teacher {tuple(teacher.shape)}"
        )
    b = len(student)
    if b < 2:
        raise ValueError(f"similarity_relation_loss needs at least 2 sentences, got {b}")

    def cosines(x: Tensor) -> Tensor:
        x = F.normalize(_acc(x), dim=-1)
        return x @ x.T  # [B, B]

    off = ~torch.eye(b, dtype=torch.bool, device=student.device)
    return (cosines(student) - cosines(teacher))[off].pow(2).mean()
