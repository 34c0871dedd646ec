"""The RG-LRU (Griffin, RecurrentGemma): gates, and the diagonal linear recurrence in three forms.

De et al. (2024), "Griffin: mixing gated linear recurrences with local attention for
efficient language models", section 2.4. Per channel, with the recurrence gate ``r_t``,
the input gate ``i_t`` and a learnt ``Lambda``:

    log a_t = -c softplus(Lambda) r_t                 (c = 8)
    h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t x_t)

A token that starts a sequence (``reset``) takes ``a_t = 0`` and no ``sqrt`` normaliser,
as RecurrentGemma does. The recurrence ``h_t = a_t h_{t-1} + u_t`` (``0 <= a_t <= 1``) is
computed one step at a time (:func:`linear_recurrence_reference`, :func:`linear_recurrence_step`)
or as a parallel scan (:func:`linear_recurrence_scan`): inside chunks of ``T`` tokens a
log-depth (Hillis-Steele) scan that only multiplies coefficients in ``[0, 1]`` (no
division, no exponent of a difference, so exact for any decay), then one carry per chunk.

Shape notation: ``B`` batch, ``L`` tokens, ``D`` channels, ``T`` chunk size.

Padding: where ``mask`` is 0 the step is skipped (``a = 1``, ``u = 0``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.functional._scan_checks import check_chunk_size, check_float, check_shape, token_mask

__all__ = [
    "linear_recurrence_reference",
    "linear_recurrence_scan",
    "linear_recurrence_step",
    "rglru_coefficients",
]

RGLRU_C = 8.0


class _SqrtBoundDerivative(torch.autograd.Function):
    """``sqrt(x)`` whose derivative is bounded (``x`` clamped at 1e-6 in the backward), as Griffin."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x.sqrt()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad / (2 * x.clamp(min=1e-6).sqrt())


def rglru_coefficients(
    x: Tensor,
    input_gate: Tensor,
    recurrence_gate: Tensor,
    recurrent_param: Tensor,
    *,
    reset: Tensor | None = None,
    mask: Tensor | None = None,
    c: float = RGLRU_C,
) -> tuple[Tensor, Tensor]:
    """The RG-LRU's ``(a, u)`` for the recurrence ``h_t = a_t h_{t-1} + u_t``.

    Args:
        x: ``[B, L, D]`` inputs.
        input_gate: ``[B, L, D]`` ``i_t`` (after its sigmoid).
        recurrence_gate: ``[B, L, D]`` ``r_t`` (after its sigmoid).
        recurrent_param: ``[D]`` ``Lambda``.
        reset: ``[B, L]`` bool, True where a sequence starts (``a = 0``, no normaliser).
        mask: ``[B, L]`` 1 = token, 0 = padding (``a = 1``, ``u = 0``: skipped).
        c: the constant of ``log a`` (8 in Griffin).

    Returns:
        ``(a [B, L, D], u [B, L, D])``.
    """
    check_float("x", x)
    if x.dim() != 3:
        raise ValueError(f"x must be (batch, seq_len, channels), got {tuple(x.shape)}")
    b, l, d = x.shape
    check_shape("input_gate", input_gate, (b, l, d), "(batch, seq_len, channels) as x")
    check_shape("recurrence_gate", recurrence_gate, (b, l, d), "(batch, seq_len, channels) as x")
    check_shape("recurrent_param", recurrent_param, (d,), "(channels,)")
    log_a = -c * recurrence_gate * F.softplus(recurrent_param)
    a = log_a.exp()
    norm = _SqrtBoundDerivative.apply(1 - (2 * log_a).exp())
    u = x * input_gate
    if reset is not None:
        if tuple(reset.shape) != (b, l):
            raise ValueError(f"reset must be (batch, seq_len) = {(b, l)}, got {tuple(reset.shape)}")
        r = reset.to(torch.bool)[..., None]
        a = a.masked_fill(r, 0.0)
        norm = torch.where(r, torch.ones_like(norm), norm)
    u = u * norm
    m = token_mask(mask, b, l, x)
    if m is not None:
        a = torch.where(m[..., None] > 0, a, torch.ones_like(a))
        u = u * m[..., None]
    return a, u


def _check(a: Tensor, u: Tensor, state: Tensor | None) -> tuple[int, int, int]:
    check_float("u", u)
    if u.dim() != 3:
        raise ValueError(f"u must be (batch, seq_len, channels), got {tuple(u.shape)}")
    b, l, d = u.shape
    check_shape("a", a, (b, l, d), "(batch, seq_len, channels) as u")
    if state is not None:
        check_shape("state", state, (b, d), "(batch, channels)")
    return b, l, d


def linear_recurrence_step(a: Tensor, u: Tensor, state: Tensor) -> Tensor:
    """One step ``h = a h_prev + u`` (``a, u, state [B, D]``); returns the new state."""
    return a * state + u


def linear_recurrence_reference(
    a: Tensor, u: Tensor, *, state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``h_t = a_t h_{t-1} + u_t`` one step at a time (the reference).

    Args:
        a: ``[B, L, D]`` coefficients in ``[0, 1]``.
        u: ``[B, L, D]`` inputs.
        state: ``[B, D]`` ``h`` before the first step (default zeros).

    Returns:
        ``(h [B, L, D], last state [B, D])``.
    """
    b, l, d = _check(a, u, state)
    h = state if state is not None else u.new_zeros((b, d))
    out = []
    for t in range(l):
        h = linear_recurrence_step(a[:, t], u[:, t], h)
        out.append(h)
    hs = torch.stack(out, dim=1) if out else u.new_zeros((b, 0, d))
    return hs, h


def linear_recurrence_scan(
    a: Tensor, u: Tensor, *, state: Tensor | None = None, chunk_size: int = 64
) -> tuple[Tensor, Tensor]:
    """``h_t = a_t h_{t-1} + u_t`` as a chunked parallel scan.

    Arguments and returns as :func:`linear_recurrence_reference`, plus ``chunk_size``
    (``T``): ``log2 T`` elementwise levels over the whole sequence, then ``L / T`` carries.
    """
    T = check_chunk_size(chunk_size)
    b, l, d = _check(a, u, state)
    if l == 0:
        return u.new_zeros((b, 0, d)), state if state is not None else u.new_zeros((b, d))
    nc = -(-l // T)
    pad = nc * T - l
    if pad:
        a = F.pad(a, (0, 0, 0, pad), value=1.0)
        u = F.pad(u, (0, 0, 0, pad))
    A = a.reshape(b, nc, T, d)
    X = u.reshape(b, nc, T, d)
    shift = 1
    while shift < T:  # Hillis-Steele: (A, X)_t <- (A_t A_{t-s}, X_t + A_t X_{t-s})
        X = X + A * F.pad(X[:, :, :-shift], (0, 0, shift, 0))
        A = A * F.pad(A[:, :, :-shift], (0, 0, shift, 0), value=1.0)
        shift *= 2
    # X: the recurrence inside each chunk from zero; A: the product of a since its start
    h = state if state is not None else u.new_zeros((b, d))
    carries = []
    for a_c, x_c in zip(A[:, :, -1].unbind(1), X[:, :, -1].unbind(1)):  # unbound once
        carries.append(h)
        h = a_c * h + x_c
    hs = X + A * torch.stack(carries, dim=1)[:, :, None]
    return hs.reshape(b, nc * T, d)[:, :l], h
