"""The selective scan of Mamba (S6): sequential reference, chunked scan and one-step update.

Gu & Dao (2023), "Mamba: linear-time sequence modeling with selective state spaces",
Algorithm 2. With input ``u``, step sizes ``delta`` (input-dependent), a diagonal state
matrix ``A`` and input-dependent ``B``, ``C``, zero-order-hold discretisation gives, per
channel ``d`` and state index ``n``:

    h_t = exp(delta_t A) * h_{t-1} + delta_t B_t u_t        (state [D, N])
    y_t = C_t . h_t + D u_t                                   (then * silu(z_t) if gated)

Shape notation: ``B`` batch, ``L`` tokens, ``D`` channels (Mamba's ``d_inner``), ``N``
state size, ``T`` chunk size. Tokens are the second dimension: ``u [B, L, D]``.

Padding: where ``mask`` is 0 the step is skipped (``delta = 0``: the state neither decays
nor takes input), so a left-padded row equals the same row run alone.

:func:`selective_scan_reference` is the sequential definition, written for clarity.
:func:`selective_scan_chunked` computes the same values with a two-level scan: every
chunk is scanned from a zero state (``T`` steps, all chunks at once) to its end state,
the end states are carried across chunks (``L / T`` steps, with a chunk's total decay
``exp((sum_t delta_t) A)``), and every chunk is scanned again from its true start state,
reading ``y_t = C_t . h_t`` as it goes (``T`` steps). The work is ``O(L)`` like the
sequential scan, in ``2 T + L / T`` vectorised steps instead of ``L``. Each step touches
``[B, L / T, D, N]`` (the state of every chunk); the only ``[L, D, N]``-sized data are the
decays ``exp(delta_t A)``, computed once in the first pass and reused in the third (the
exponential is the costliest element-wise op here). This is faster than a sequential
loop over one ``[B, D, N]`` state (``L`` small steps: per-op overhead) and than a scan
over several materialised ``[L, D, N]`` tensors (memory traffic).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.functional._scan_checks import check_chunk_size, check_float, check_shape, token_mask
from attnlab.functional.ssm_backward import SelectiveScanFn

__all__ = ["selective_scan_chunked", "selective_scan_reference", "selective_scan_step"]


def _prepare(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    delta_bias: Tensor | None,
    delta_softplus: bool,
    mask: Tensor | None,
    initial_state: Tensor | None,
) -> Tensor:
    """Validate; return the step sizes ``delta [B, L, D]`` after bias, softplus and mask."""
    check_float("u", u)
    if u.dim() != 3:
        raise ValueError(f"u must be (batch, seq_len, channels), got {tuple(u.shape)}")
    b, l, d = u.shape
    check_shape("delta", delta, (b, l, d), "(batch, seq_len, channels)")
    check_float("A", A)
    if A.dim() != 2 or A.shape[0] != d:
        raise ValueError(f"A must be (channels={d}, state_size), got {tuple(A.shape)}")
    n = A.shape[1]
    check_shape("B", B, (b, l, n), "(batch, seq_len, state_size)")
    check_shape("C", C, (b, l, n), "(batch, seq_len, state_size)")
    if D is not None:
        check_shape("D", D, (d,), "(channels,)")
    if z is not None:
        check_shape("z", z, (b, l, d), "(batch, seq_len, channels)")
    if delta_bias is not None:
        check_shape("delta_bias", delta_bias, (d,), "(channels,)")
    if initial_state is not None:
        check_shape("initial_state", initial_state, (b, d, n), "(batch, channels, state_size)")
    if delta_bias is not None:
        delta = delta + delta_bias
    if delta_softplus:
        delta = F.softplus(delta)
    m = token_mask(mask, b, l, delta)
    if m is not None:
        delta = delta * m[..., None]  # a skipped step: no decay, no input
    return delta


def _finish(y: Tensor, u: Tensor, D: Tensor | None, z: Tensor | None) -> Tensor:
    if D is not None:
        y = y + u * D
    if z is not None:
        y = y * F.silu(z)
    return y


def selective_scan_reference(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    *,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
    mask: Tensor | None = None,
    initial_state: Tensor | None = None,
    return_final_state: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Mamba's selective scan, one token at a time (the definition).

    Args:
        u: ``[B, L, D]`` input.
        delta: ``[B, L, D]`` step sizes (before ``delta_bias``/softplus when those are given).
        A: ``[D, N]`` continuous state matrix (diagonal per channel; negative for decay).
        B: ``[B, L, N]`` input matrix per token.
        C: ``[B, L, N]`` output matrix per token.
        D: ``[D]`` skip connection, or None.
        z: ``[B, L, D]`` gate (output multiplied by ``silu(z)``), or None.
        delta_bias: ``[D]`` added to ``delta`` first.
        delta_softplus: apply softplus to ``delta`` (after the bias).
        mask: ``[B, L]`` 1 = token, 0 = padding (the step is skipped).
        initial_state: ``[B, D, N]`` state before the first token (default zeros).
        return_final_state: also return the state after the last token.

    Returns:
        ``y [B, L, D]``, and the final state ``[B, D, N]`` when asked for.

    Raises:
        ValueError: shapes that do not fit each other (the message names the argument).
        TypeError: a non-floating tensor.
    """
    delta = _prepare(u, delta, A, B, C, D, z, delta_bias, delta_softplus, mask, initial_state)
    b, l, d = u.shape
    a = torch.exp(delta[..., None] * A)  # [B, L, D, N]
    inp = (delta * u)[..., None] * B[:, :, None, :]  # [B, L, D, N]
    h = initial_state if initial_state is not None else u.new_zeros((b, d, A.shape[1]))
    ys = []
    for t in range(l):
        h = a[:, t] * h + inp[:, t]  # [B, D, N]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, t]))
    y = torch.stack(ys, dim=1) if ys else u.new_zeros((b, 0, d))  # [B, L, D]
    y = _finish(y, u, D, z)
    return (y, h) if return_final_state else y


def selective_scan_chunked(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    *,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
    mask: Tensor | None = None,
    initial_state: Tensor | None = None,
    return_final_state: bool = False,
    chunk_size: int = 64,
) -> Tensor | tuple[Tensor, Tensor]:
    """The selective scan in chunks: equal to :func:`selective_scan_reference`, faster.

    Arguments and returns as :func:`selective_scan_reference`, plus ``chunk_size`` (tokens
    per chunk, ``T``; any positive int, the sequence is padded to a multiple of it).
    """
    T = check_chunk_size(chunk_size)
    delta = _prepare(u, delta, A, B, C, D, z, delta_bias, delta_softplus, mask, initial_state)
    b, l, d = u.shape
    n = A.shape[1]
    nc = max(1, -(-l // T))
    pad = nc * T - l
    du = delta * u  # [B, L, D]
    s = initial_state if initial_state is not None else u.new_zeros((b, d, n))
    if torch.is_grad_enabled() and any(x.requires_grad for x in (delta, du, A, B, C, s)):
        # training: the reverse-scan backward (functional/ssm_backward.py), no graph over
        # tokens
        y, s = SelectiveScanFn.apply(delta, du, A, B, C, s)
        y = _finish(y, u, D, z)
        return (y, s) if return_final_state else y
    if pad:  # padded steps have delta = 0: no decay, no input, the state passes unchanged
        delta, du = (F.pad(x, (0, 0, 0, pad)) for x in (delta, du))
        B, C = (F.pad(x, (0, 0, 0, pad)) for x in (B, C))
    y, s = _scan(delta, du, A, B, C, s, T)
    y = _finish(y[:, :l], u, D, z)
    return (y, s) if return_final_state else y


def _scan(
    delta: Tensor,
    du: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    s: Tensor,
    T: int,
) -> tuple[Tensor, Tensor]:
    """The two-level scan on padded inputs (``L`` a multiple of ``T``): ``(y [B, L, D],
    final state)``, updating the states in place (no autograd: the backward is
    :class:`attnlab.functional.ssm_backward.SelectiveScanFn`'s)."""
    b, lp, d = du.shape
    n = A.shape[1]
    nc = lp // T
    dl = delta.view(b, nc, T, d, 1)
    dul = du.view(b, nc, T, d, 1)
    Bc = B.view(b, nc, T, 1, n)
    Cc = C.view(b, nc, T, 1, n)
    decays: list[Tensor] = []  # exp(delta_t A) per step [B, nc, D, N], kept from pass 1 for pass 3
    work = du.new_empty((b, nc, d, n))  # scratch of the in-place steps

    def decay(t: int) -> Tensor:
        if t < len(decays):
            return decays[t]
        return (dl[:, :, t] * A).exp_()  # [B, nc, D, N]

    def update(h: Tensor, a: Tensor, t: int) -> Tensor:
        # h_t = exp(delta_t A) h_{t-1} + delta_t u_t B_t, in every chunk at once
        return h.mul_(a).add_(torch.mul(dul[:, :, t], Bc[:, :, t], out=work))

    def read(h: Tensor, t: int) -> Tensor:
        # y_t = C_t . h_t  [B, nc, D]
        return torch.mul(h, Cc[:, :, t], out=work).sum(-1)

    if nc == 1:
        starts = s[:, None].clone()  # [B, 1, D, N]
    else:
        # 1. each chunk's end state from a zero start, all chunks at once (T steps)
        h = du.new_zeros((b, nc, d, n))
        for t in range(T):
            decays.append(decay(t))
            h = update(h, decays[t], t)
        # a chunk's total decay: prod_t exp(delta_t A) = exp((sum_t delta_t) A)
        total = torch.exp(dl.sum(2) * A)  # [B, nc, D, N]
        # 2. carry the states across chunks (nc steps)
        carried = []
        for c in range(nc):
            carried.append(s)
            s = torch.addcmul(h[:, c], total[:, c], s)
        starts = torch.stack(carried, 1)  # [B, nc, D, N]
    # 3. scan every chunk again from its true start, reading y_t as it goes (T steps)
    h = starts
    ys = []
    for t in range(T):
        h = update(h, decay(t), t)
        ys.append(read(h, t))
    if nc == 1:
        s = h[:, 0]
    y = torch.stack(ys, 2).reshape(b, nc * T, d)  # [B, L, D]
    return y, s


def selective_scan_step(
    state: Tensor,
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    *,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """One decoding step: ``u, delta, z [B, D]``, ``B, C [B, N]``, ``state [B, D, N]``.

    Returns:
        ``(y [B, D], new state [B, D, N])``; equal to the reference on a one-token input.
    """
    b, d = u.shape[0], u.shape[-1]
    y, h = selective_scan_reference(
        u.reshape(b, 1, d),
        delta.reshape(b, 1, d),
        A,
        B.reshape(b, 1, -1),
        C.reshape(b, 1, -1),
        D,
        None if z is None else z.reshape(b, 1, d),
        delta_bias=delta_bias,
        delta_softplus=delta_softplus,
        mask=None if mask is None else mask.reshape(b, 1),
        initial_state=state,
        return_final_state=True,
    )
    return y[:, 0], h
