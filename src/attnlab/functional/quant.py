"""Weight-only quantization: the reference math of attnlab's quantized linear layers.

Two layouts, both grouped along the input dimension (a row of ``K`` weights is ``K / G``
consecutive groups of ``G``; per output channel is ``G = K``):

- **int8, symmetric**: ``w = scale * q`` with ``q`` in ``-127..127`` (GGUF's Q8_0 is this
  layout with ``G = 32``; LLM.int8()'s weight-only half, Dettmers et al., 2022, is
  ``G = K``).
- **int4, asymmetric**: ``w = scale * q + min`` with ``q`` in ``0..15`` (GGUF's Q4_1 with
  ``G = 32``; Q4_0's ``d * (q - 8)`` is the same form with ``min = -8 d``), as GPTQ/AWQ
  store group-wise 4-bit weights (Frantar et al., 2023; Lin et al., 2024).

Rounding follows llama.cpp's reference quantizers (``quantize_row_q8_0_ref``,
``quantize_row_q4_1_ref``): ``scale = amax / 127`` (int8) and ``scale = (max - min) / 15``,
``q = round((w - min) / scale)`` (int4). 4-bit levels are stored two per byte, the even
column in the low nibble.

Activations can be quantized too (:func:`quantize_act_q8`), as llama.cpp does before it
multiplies quantized weights on the CPU: blocks of 32 along ``K``, ``d = amax / 127``
stored in float16, ``q = round_half_even(x * (127 / amax))`` (its ``quantize_row_q8_0``
and ``quantize_row_q8_1`` for x86, ``ggml/src/ggml-cpu/arch/x86/quants.c``), and for
Q8_1 the block's ``sx = fp16(d * sum q)``.

Shape notation: ``N`` output features, ``K`` input features, ``G`` group size,
``M`` rows of activations.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab._validate import check_positive_int

__all__ = [
    "check_group_size",
    "dequantize_int4",
    "dequantize_int8",
    "pack_nibbles",
    "quantize_act_q8",
    "quantize_int4",
    "quantize_int8",
    "quantized_linear_reference",
    "unpack_nibbles",
]


def check_group_size(group_size: int, in_features: int, *, bits: int) -> int:
    """``group_size`` if it divides ``in_features`` (and is even for 4-bit levels).

    Raises:
        ValueError: a group size that is not a positive divisor of ``in_features``.
    """
    check_positive_int("group_size", group_size)
    if in_features % group_size or (bits == 4 and group_size % 2):
        raise ValueError(
            f"group_size ({group_size}) must divide in_features ({in_features})"
            + (" and be even for 4-bit weights" if bits == 4 else "")
        )
    return group_size


def _grouped(w: Tensor, group_size: int, bits: int) -> Tensor:
    if not isinstance(w, Tensor) or w.dim() != 2 or not w.is_floating_point():
        what = f"shape {tuple(w.shape)} {w.dtype}" if isinstance(w, Tensor) else type(w).__name__
        raise ValueError(f"weight must be a 2-D float tensor [out, in], got {what}")
    n, k = w.shape
    check_group_size(group_size, k, bits=bits)
    return w.detach().to(torch.float32).reshape(n, k // group_size, group_size)  # [N, K/G, G]


def quantize_int8(w: Tensor, group_size: int | None = None) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per group: ``(q int8 [N, K], scales float32 [N, K/G])``.

    Args:
        w: ``[N, K]`` float weights.
        group_size: ``G`` (default ``K``: one scale per output channel).
    """
    g = _grouped(w, w.shape[-1] if group_size is None else group_size, 8)
    amax = g.abs().amax(dim=-1)  # [N, K/G]
    scales = amax / 127.0
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    q = torch.round(g * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(w.shape), scales


def quantize_int4(w: Tensor, group_size: int = 32) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric 4-bit per group: ``(levels uint8 [N, K] in 0..15, scales, mins [N, K/G])``.

    Args:
        w: ``[N, K]`` float weights.
        group_size: ``G`` (32, 64 or 128 are the usual choices).
    """
    g = _grouped(w, group_size, 4)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)  # [N, K/G]
    scales = (hi - lo) / 15.0
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    q = torch.round((g - lo[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(w.shape), scales, lo


def pack_nibbles(levels: Tensor) -> Tensor:
    """``[N, K]`` levels in ``0..15`` -> ``[N, K/2]`` uint8, column ``2j`` in the low nibble."""
    lv = levels.to(torch.uint8)
    return lv[:, 0::2] | (lv[:, 1::2] << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_nibbles`: ``[N, K/2]`` uint8 -> ``[N, K]`` uint8 levels."""
    n = packed.shape[0]
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(n, -1)


def dequantize_int8(q: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``scale * q`` as ``[N, K]`` of ``dtype`` (computed in float32, or float64 if asked)."""
    n, k = q.shape
    work = torch.float64 if dtype == torch.float64 else torch.float32
    w = q.reshape(n, scales.shape[1], -1).to(work) * scales.to(work)[..., None]
    return w.reshape(n, k).to(dtype)


def dequantize_int4(
    levels: Tensor, scales: Tensor, mins: Tensor, dtype: torch.dtype = torch.float32
) -> Tensor:
    """``scale * q + min`` as ``[N, K]`` of ``dtype`` from unpacked ``levels [N, K]``."""
    n, k = levels.shape
    work = torch.float64 if dtype == torch.float64 else torch.float32
    w = levels.reshape(n, scales.shape[1], -1).to(work) * scales.to(work)[..., None]
    w = w + mins.to(work)[..., None]
    return w.reshape(n, k).to(dtype)


def quantized_linear_reference(
    x: Tensor,
    q: Tensor,
    scales: Tensor,
    mins: Tensor | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    """``x @ dequantize(q)^T + bias`` in float64: the reference every kernel is tested against.

    Args:
        x: ``[..., K]`` activations.
        q: int8 ``[N, K]`` (with ``mins`` None) or 4-bit levels ``[N, K]`` (with ``mins``).
        scales: ``[N, K/G]``.
        mins: ``[N, K/G]`` for the 4-bit layout.
        bias: ``[N]`` or None.

    Returns:
        ``[..., N]`` float64.
    """
    if mins is None:
        w = dequantize_int8(q, scales, torch.float64)
    else:
        w = dequantize_int4(q, scales, mins, torch.float64)
    y = x.to(torch.float64) @ w.T
    return y if bias is None else y + bias.to(torch.float64)


def quantize_act_q8(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Activations ``[M, K]`` -> llama.cpp's Q8_0/Q8_1 blocks, in float32 tensors.

    Per block of 32: ``amax = max |x|``, ``d = fp16(amax / 127)``, levels
    ``q = round_half_even(x * (127 / amax))`` (0 where ``amax = 0``; the multiplier and
    product in float32, as ggml's x86 code computes them) and ``sx = fp16((amax / 127) *
    sum q)``.

    Returns:
        ``q [M, K/32, 32]`` (integers in -127..127), ``d [M, K/32, 1]``, ``sx [M, K/32, 1]``.

    Raises:
        ValueError: ``x`` not 2-D float32 with ``K`` a multiple of 32.
    """
    if x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] % 32:
        raise ValueError(
            f"x must be float32 [M, K] with K a multiple of 32, got {x.dtype} {tuple(x.shape)}"
        )
    xb = x.reshape(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    mul = torch.where(amax != 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(xb * mul)
    d = amax / 127.0
    sx = (d * q.sum(-1, keepdim=True)).to(torch.float16).to(torch.float32)
    return q, d.to(torch.float16).to(torch.float32), sx
