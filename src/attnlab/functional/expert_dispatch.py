"""Running routed tokens through batched experts: the reference loop and two fast dispatches.

Shape notation: ``N`` tokens, ``D`` width, ``E`` experts, ``k`` experts per token,
``F`` expert inner width, ``F_in`` = ``2F`` for gated experts (gate rows, then up rows,
as transformers stores ``gate_up_proj``) or ``F``, ``C`` capacity, ``A = N * k``
assignments.

Expert weights are batched like ``nn.Linear`` weights: ``w_in [E, F_in, D]``,
``w_out [E, D, F]``; expert ``e`` computes ``w_out[e] @ act(w_in[e] @ x)`` (gated:
``w_out[e] @ (act(gate) * up)``, SwiGLU with ``silu``, Shazeer 2020).

* :func:`moe_reference`: the readable reference, a Python loop over tokens and their
  chosen experts, one small matmul per (token, expert) pair.
* :func:`moe_capacity`: Switch/GShard dispatch (Fedus et al., 2021; Lepikhin et al.,
  2020): each expert has ``C`` slots, filled first by first choices then by second
  choices in token order; assignments past ``C`` are dropped (their weight is lost, the
  residual carries the token). Returns the dropped share. Fixed shapes: ``[E, C, D]``.
* :func:`moe_dropless`: sort the assignments by expert and run each expert on its
  contiguous group with one grouped matmul (the MegaBlocks idea, Gale et al., 2022),
  ``torch._grouped_mm`` where the installed torch has it and the strides allow, a padded
  batched matmul otherwise. Nothing is dropped.
* :func:`moe_expert_choice`: expert-choice routing's dispatch (each expert's ``C``
  tokens are given), a batched matmul over ``[E, C, D]``, and its loop reference.

All four give the same output when nothing is dropped (tested forward and backward).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from attnlab.functional.routing import ExpertChoice, TokenChoice

__all__ = [
    "CapacityResult",
    "expert_ffn",
    "grouped_mm_available",
    "moe_capacity",
    "moe_dropless",
    "moe_expert_choice",
    "moe_expert_choice_reference",
    "moe_reference",
    "sort_by_expert",
]

Activation = Callable[[Tensor], Tensor]


class CapacityResult(NamedTuple):
    """Output of :func:`moe_capacity`.

    Attributes:
        output: ``[N, D]``.
        dropped: float32 scalar, the share of the ``N * k`` assignments that overflowed.
        kept: ``[N, k]`` bool, which assignments were computed.
    """

    output: Tensor
    dropped: Tensor
    kept: Tensor


def _gate(h: Tensor, activation: Activation, gated: bool) -> Tensor:
    if not gated:
        return activation(h)
    gate, up = h.chunk(2, dim=-1)
    return activation(gate) * up


def expert_ffn(
    x: Tensor, w_in: Tensor, w_out: Tensor, *, activation: Activation, gated: bool
) -> Tensor:
    """One expert: ``[n, D] -> [n, D]`` with ``w_in [F_in, D]``, ``w_out [D, F]``."""
    return _gate(x @ w_in.t(), activation, gated) @ w_out.t()


def moe_reference(
    x: Tensor,
    routing: TokenChoice,
    w_in: Tensor,
    w_out: Tensor,
    *,
    activation: Activation,
    gated: bool,
) -> Tensor:
    """The per-token loop: ``y[t] = sum_j weights[t, j] * expert_{experts[t, j]}(x[t])``.

    Args:
        x: ``[N, D]`` tokens.
        routing: ``[N, k]`` weights and expert ids.
        w_in: ``[E, F_in, D]``.
        w_out: ``[E, D, F]``.
        activation: the experts' activation.
        gated: gated (SwiGLU-style) experts.

    Returns:
        ``[N, D]`` in ``x``'s dtype.
    """
    rows = []
    experts = routing.experts.tolist()
    for t in range(x.shape[0]):
        y = torch.zeros_like(x[t : t + 1])  # [1, D]
        for j, e in enumerate(experts[t]):
            out = expert_ffn(x[t : t + 1], w_in[e], w_out[e], activation=activation, gated=gated)
            y = y + (routing.weights[t, j] * out).to(x.dtype)
        rows.append(y)
    return torch.cat(rows) if rows else torch.zeros_like(x)


def sort_by_expert(experts: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """``(order [A], counts [E])``: assignment indices (into ``experts.reshape(-1)``) sorted
    by expert, stable, and the number of assignments per expert."""
    flat = experts.reshape(-1)  # [A]
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    return order, counts


def grouped_mm_available(*tensors: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs here on these operands (float32/bfloat16, strides
    in multiples of 16 bytes, which its CPU and CUDA kernels require)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    for t in tensors:
        if t.dtype not in (torch.float32, torch.bfloat16):
            return False
        if (t.shape[-1] * t.element_size()) % 16 or (t.shape[-2] * t.element_size()) % 16:
            return False
    return True


def _grouped_linear(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """``x [A, K]`` sorted by group, ``w [E, M, K]`` -> ``[A, M]`` (row ``i`` times ``w[g(i)]^T``)."""
    return torch._grouped_mm(x, w.transpose(1, 2), offs=offsets)


def _padded_linear(x: Tensor, w: Tensor, counts: Tensor, slot: Tensor, group: Tensor) -> Tensor:
    """The same as :func:`_grouped_linear` with a padded ``[E, max_count, K]`` batch."""
    e = w.shape[0]
    width = int(counts.max()) if counts.numel() else 0
    buf = x.new_zeros(e, max(width, 1), x.shape[-1])  # [E, M_max, K]
    buf = buf.index_put((group, slot), x)
    out = torch.bmm(buf, w.transpose(1, 2))  # [E, M_max, M]
    return out[group, slot]  # [A, M]


def moe_dropless(
    x: Tensor,
    routing: TokenChoice,
    w_in: Tensor,
    w_out: Tensor,
    *,
    activation: Activation,
    gated: bool,
    use_grouped_mm: bool | None = None,
) -> Tensor:
    """Dropless dispatch: sort assignments by expert, grouped matmuls, weighted scatter-add.

    Args:
        x: ``[N, D]``.
        routing: ``[N, k]`` weights and expert ids.
        w_in: ``[E, F_in, D]``.
        w_out: ``[E, D, F]``.
        activation: the experts' activation.
        gated: gated experts.
        use_grouped_mm: force (True) or forbid (False) ``torch._grouped_mm``; None picks
            it when :func:`grouped_mm_available`.

    Returns:
        ``[N, D]``.
    """
    n, k = routing.experts.shape
    num_experts = w_in.shape[0]
    order, counts = sort_by_expert(routing.experts, num_experts)  # [A], [E]
    token = order // k  # [A] token of each sorted assignment
    xs = x[token]  # [A, D]
    if use_grouped_mm is None:
        use_grouped_mm = grouped_mm_available(xs, w_in, w_out)
    if use_grouped_mm:
        offsets = torch.cumsum(counts, 0).to(torch.int32)  # [E]
        h = _gate(_grouped_linear(xs, w_in, offsets), activation, gated)  # [A, F]
        ys = _grouped_linear(h, w_out, offsets)  # [A, D]
    else:
        group = routing.experts.reshape(-1)[order]  # [A]
        starts = torch.cumsum(counts, 0) - counts  # [E]
        slot = torch.arange(order.numel(), device=x.device) - starts[group]  # [A]
        h = _gate(_padded_linear(xs, w_in, counts, slot, group), activation, gated)
        ys = _padded_linear(h, w_out, counts, slot, group)
    ys = ys * routing.weights.reshape(-1)[order, None].to(ys.dtype)  # [A, D]
    return x.new_zeros(n, x.shape[-1]).index_add(0, token, ys.to(x.dtype))


def moe_capacity(
    x: Tensor,
    routing: TokenChoice,
    w_in: Tensor,
    w_out: Tensor,
    *,
    capacity: int,
    activation: Activation,
    gated: bool,
) -> CapacityResult:
    """Capacity-factor dispatch with dropping (Switch Transformer, sec. 2.2).

    Slots are given in priority order: every token's first choice (in token order), then
    every token's second choice, and so on, as GShard's and Switch's cumulative-sum
    positions do. An assignment whose expert is full is dropped.

    Args:
        x: ``[N, D]``.
        routing: ``[N, k]`` weights and expert ids.
        w_in: ``[E, F_in, D]``.
        w_out: ``[E, D, F]``.
        capacity: ``C`` slots per expert (:func:`~attnlab.functional.routing.expert_capacity`).
        activation: the experts' activation.
        gated: gated experts.

    Returns:
        :class:`CapacityResult` (output, dropped share, kept mask).
    """
    n, k = routing.experts.shape
    num_experts = w_in.shape[0]
    by_priority = routing.experts.t().reshape(-1)  # [k * N], slot-major
    onehot = torch.nn.functional.one_hot(by_priority, num_experts)  # [k*N, E]
    position = ((torch.cumsum(onehot, 0) - 1) * onehot).sum(-1)  # [k*N] slot in its expert
    kept_pm = position < capacity  # [k*N]
    kept = kept_pm.view(k, n).t()  # [N, k]
    idx = kept_pm.nonzero().squeeze(-1)  # [A_kept]
    expert, slot = by_priority[idx], position[idx]
    token = idx % n
    buf = x.new_zeros(num_experts, capacity, x.shape[-1]).index_put((expert, slot), x[token])
    h = _gate(torch.bmm(buf, w_in.transpose(1, 2)), activation, gated)  # [E, C, F]
    out = torch.bmm(h, w_out.transpose(1, 2))  # [E, C, D]
    weight = routing.weights.t().reshape(-1)[idx]  # [A_kept]
    ys = out[expert, slot] * weight[:, None].to(out.dtype)  # [A_kept, D]
    y = x.new_zeros(n, x.shape[-1]).index_add(0, token, ys.to(x.dtype))
    dropped = (
        1.0 - kept_pm.float().mean()
        if kept_pm.numel()
        else kept_pm.new_zeros((), dtype=torch.float32)
    )
    return CapacityResult(y, dropped, kept)


def moe_expert_choice(
    x: Tensor,
    routing: ExpertChoice,
    w_in: Tensor,
    w_out: Tensor,
    *,
    activation: Activation,
    gated: bool,
) -> Tensor:
    """Expert-choice dispatch (Zhou et al., 2022): gather ``[E, C, D]``, batched matmuls,
    weighted scatter-add back to the tokens. Not causal (see :mod:`.routing`)."""
    e, c = routing.tokens.shape
    buf = x[routing.tokens.reshape(-1)].view(e, c, x.shape[-1])  # [E, C, D]
    h = _gate(torch.bmm(buf, w_in.transpose(1, 2)), activation, gated)  # [E, C, F]
    out = torch.bmm(h, w_out.transpose(1, 2))  # [E, C, D]
    out = out * routing.weights[..., None].to(out.dtype)
    return x.new_zeros(x.shape).index_add(0, routing.tokens.reshape(-1), out.reshape(e * c, -1))


def moe_expert_choice_reference(
    x: Tensor,
    routing: ExpertChoice,
    w_in: Tensor,
    w_out: Tensor,
    *,
    activation: Activation,
    gated: bool,
) -> Tensor:
    """Loop reference of :func:`moe_expert_choice`: each expert, each of its tokens."""
    y = torch.zeros_like(x)
    tokens = routing.tokens.tolist()
    for e, row in enumerate(tokens):
        for c, t in enumerate(row):
            out = expert_ffn(x[t : t + 1], w_in[e], w_out[e], activation=activation, gated=gated)
            y = y.index_add(
                0, torch.tensor([t], device=x.device), (routing.weights[e, c] * out).to(x.dtype)
            )
    return y
