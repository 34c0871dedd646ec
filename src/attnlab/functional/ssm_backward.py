"""A reverse-scan backward for Mamba's selective scan (no autograd graph over tokens).

Autograd through :func:`attnlab.functional.selective_scan.selective_scan_chunked` records
every step of its three passes (``2 T + L / T`` steps of a few ops each, per layer), and
its backward replays them one by one. :class:`SelectiveScanFn` instead runs the forward
without a graph and computes the gradients with one more scan in reverse. With
``a_t = exp(delta_t A)`` and ``x_t = (delta_t u_t) B_t`` (``[D, N]`` per token),
``h_t = a_t h_{t-1} + x_t`` and ``y_t = h_t C_t``, the adjoint state
``g_t = dL/dh_t`` obeys the same recurrence backwards in time,

    g_t = a_{t+1} g_{t+1} + dy_t C_t^T                 (g_L = the final state's gradient)

and every input's gradient is a sum of products of ``h``, ``g`` and the inputs:
``dC_t = h_t^T dy_t``, ``d(delta u)_t = g_t B_t``, ``dB_t = g_t^T (delta u)_t``, and, with
``q_t = g_t . a_t . h_{t-1}`` (the gradient through the decay), ``d delta_t = sum_n q_t A``,
``dA = sum_t q_t delta_t``, ``dh_0 = a_1 . g_1`` (Gu & Dao, 2023, section 3.3.2, recompute
the states in the backward instead of storing them).

The states are recomputed in the backward (the forward keeps only its inputs), one layer
at a time: the backward holds a few ``[B, L, D, N]`` tensors, the forward none.
Shapes: ``B`` batch, ``L`` tokens (a multiple of the chunk size ``T``), ``D`` channels,
``N`` state size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["SelectiveScanFn"]


def _block(b: int, d: int, n: int, limit: int) -> int:
    """Tokens per block: about 2^17 numbers per ``[B, block, D, N]`` tensor (in cache)."""
    return max(1, min(limit, 2**17 // max(1, b * d * n)))


def _forward_blocks(
    delta: Tensor, du: Tensor, A: Tensor, B: Tensor, C: Tensor, h0: Tensor, blk: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``(y [B, L, D], h_L, the state entering every block [B, L / blk, D, N])``."""
    b, l, d = du.shape
    y = du.new_empty((b, l, d))
    starts = du.new_empty((b, -(-l // blk), d, A.shape[1]))
    h = h0.clone()
    for i, t0 in enumerate(range(0, l, blk)):
        t1 = min(t0 + blk, l)
        starts[:, i] = h
        H = (delta[:, t0:t1, :, None] * A).exp_()  # a_t [B, blk, D, N]
        x = du[:, t0:t1, :, None] * B[:, t0:t1, None, :]
        for t in range(t1 - t0):
            h = H[:, t].mul_(h).add_(x[:, t])  # h_t = a_t h_{t-1} + x_t, kept in H
        h = h.clone()  # H is overwritten next
        y[:, t0:t1] = H.mul_(C[:, t0:t1, None, :]).sum(-1)  # y_t = C_t . h_t
    return y, h, starts


class SelectiveScanFn(torch.autograd.Function):
    """``(y, h_L) = scan(delta, du, A, B, C, h0)``: the bare selective scan
    (``y_t = C_t . h_t``, no ``D`` skip, no gate), with the reverse-scan backward.

    Inputs: ``delta, du [B, L, D]`` (``du = delta * u``), ``A [D, N]``, ``B, C [B, L, N]``,
    ``h0 [B, D, N]``; ``L`` a multiple of ``chunk_size``. Forward computed by ``forward_fn``
    (the chunked scan, called without a graph).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, delta: Tensor, du: Tensor, A: Tensor, B: Tensor, C: Tensor, h0: Tensor
    ) -> tuple[Tensor, Tensor]:
        b, _, d = du.shape
        blk = _block(b, d, A.shape[1], 64)
        with torch.no_grad():
            y, h, starts = _forward_blocks(delta, du, A, B, C, h0, blk)
        ctx.save_for_backward(delta, du, A, B, C, starts)
        ctx.blk = blk
        return y, h

    @staticmethod
    def backward(ctx: Any, gy: Tensor | None, gh: Tensor | None) -> Any:  # type: ignore[override]
        delta, du, A, B, C, starts = ctx.saved_tensors
        blk = ctx.blk
        b, l, d = du.shape
        n = A.shape[1]
        if gy is None:
            gy = torch.zeros_like(du)
        d_delta, d_du = torch.empty_like(delta), torch.empty_like(du)
        dB, dC = torch.empty_like(B), torch.empty_like(C)
        dA = torch.zeros_like(A)
        g = gh.clone() if gh is not None else du.new_zeros((b, d, n))  # dL/dh after the block
        blocks = list(enumerate(range(0, l, blk)))
        for i, t0 in reversed(blocks):
            t1 = min(t0 + blk, l)
            dt, x_in, Bt, Ct = delta[:, t0:t1], du[:, t0:t1], B[:, t0:t1], C[:, t0:t1]
            a = (dt[..., None] * A).exp_()  # [B, blk, D, N]
            x = x_in[..., None] * Bt[:, :, None, :]
            H = x.clone()  # the states again, from the block's saved start
            h = starts[:, i]
            for t in range(t1 - t0):
                h = H[:, t].addcmul_(a[:, t], h)
            # the adjoint states, backwards: g_t = a_{t+1} g_{t+1} + dy_t C_t
            G = gy[:, t0:t1, :, None] * Ct[:, :, None, :]
            for t in range(t1 - t0 - 1, -1, -1):
                g = G[:, t].add_(g)
                g = a[:, t] * g  # what flows to h_{t-1}
            # (products then sums: on blocks this small they beat einsum's tiny matmuls)
            dC[:, t0:t1] = torch.mul(H, gy[:, t0:t1, :, None], out=a).sum(2)
            d_du[:, t0:t1] = torch.mul(G, Bt[:, :, None, :], out=a).sum(-1)
            dB[:, t0:t1] = torch.mul(G, x_in[..., None], out=a).sum(2)
            q = G.mul_(H.sub_(x))  # g_t . a_t h_{t-1}: the gradient through exp(delta_t A)
            d_delta[:, t0:t1] = torch.mul(q, A, out=a).sum(-1)
            dA += q.mul_(dt[..., None]).sum((0, 1))
        return d_delta, d_du, dA, dB, dC, g
