"""The causal depthwise short convolution (LFM2, and the conv of Mamba/GDN/Griffin), three forms.

Liquid AI (2025), LFM2: a gated short convolution ``y = C * conv(B * x)`` with a kernel of
``K = 3``; the convolution is depthwise and causal:

    y_t[c] = bias[c] + sum_{j=0}^{K-1} w[c, j] x_{t-K+1+j}[c]          (x_{<0}: zeros or the state)

:func:`short_conv_reference` is that sum written out; :func:`short_conv` is one
``conv1d`` over the window (the parallel form); :func:`short_conv_step` is one decoding
step over a stored window of ``K - 1`` inputs.

Shape notation: ``B`` batch, ``L`` tokens, ``C`` channels, ``K`` kernel width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.functional._scan_checks import check_float, check_shape

__all__ = ["short_conv", "short_conv_reference", "short_conv_step"]


def _check(x: Tensor, weight: Tensor, bias: Tensor | None, state: Tensor | None) -> int:
    check_float("x", x)
    if x.dim() != 3:
        raise ValueError(f"x must be (batch, seq_len, channels), got {tuple(x.shape)}")
    b, _, c = x.shape
    check_float("weight", weight)
    if weight.dim() != 2 or weight.shape[0] != c:
        raise ValueError(f"weight must be (channels={c}, kernel), got {tuple(weight.shape)}")
    k = weight.shape[1]
    if bias is not None:
        check_shape("bias", bias, (c,), "(channels,)")
    if state is not None:
        check_shape("state", state, (b, k - 1, c), "(batch, kernel - 1, channels)")
    return k


def _window(x: Tensor, state: Tensor | None, k: int) -> Tensor:
    prev = state if state is not None else x.new_zeros((x.shape[0], k - 1, x.shape[2]))
    return torch.cat((prev.to(x.dtype), x), dim=1)  # [B, K-1+L, C]


def short_conv_reference(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, *, state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The causal depthwise convolution as the explicit sum (the reference).

    Args:
        x: ``[B, L, C]`` inputs.
        weight: ``[C, K]`` per-channel taps (``conv1d``'s ``[C, 1, K]`` squeezed).
        bias: ``[C]`` or None.
        state: ``[B, K-1, C]`` the inputs before ``x`` (default zeros).

    Returns:
        ``(y [B, L, C], the last K-1 inputs [B, K-1, C])``.
    """
    k = _check(x, weight, bias, state)
    window = _window(x, state, k)
    l = x.shape[1]
    y = sum(window[:, j : j + l] * weight[:, j] for j in range(k))
    assert isinstance(y, Tensor)
    if bias is not None:
        y = y + bias
    return y, window[:, window.shape[1] - (k - 1) :]


def short_conv(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, *, state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The same convolution as one grouped ``conv1d`` (the parallel form); as :func:`short_conv_reference`."""
    k = _check(x, weight, bias, state)
    window = _window(x, state, k)
    y = F.conv1d(window.transpose(1, 2), weight[:, None], bias, groups=x.shape[2])  # [B, C, L]
    return y.transpose(1, 2), window[:, window.shape[1] - (k - 1) :]


def short_conv_step(
    x: Tensor, weight: Tensor, bias: Tensor | None, state: Tensor
) -> tuple[Tensor, Tensor]:
    """One decoding step: ``x [B, C]`` after the window ``state [B, K-1, C]``.

    Returns:
        ``(y [B, C], the new window [B, K-1, C])``.
    """
    window = torch.cat((state.to(x.dtype), x[:, None]), dim=1)  # [B, K, C]
    y = (window * weight.t()).sum(1)
    if bias is not None:
        y = y + bias
    return y, window[:, 1:]
