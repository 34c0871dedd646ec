"""Validation shared by the recurrent references (selective scan, SSD, WKV, retention).

Each helper raises ``ValueError``/``TypeError`` naming the argument, its value and what
is accepted, so a wrong state shape or chunk size never surfaces as a broadcasting error.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.functional._checks import check_positive_int, check_tensor

__all__ = ["check_chunk_size", "check_float", "check_shape", "token_mask"]


def check_float(name: str, x: object) -> Tensor:
    """``x`` as a floating tensor, else ``TypeError`` naming ``name``."""
    t = check_tensor(name, x)
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    return t


def check_shape(name: str, x: object, expected: tuple[int, ...], what: str) -> Tensor:
    """``x`` with exactly the shape ``expected`` (described by ``what``), else ``ValueError``."""
    t = check_float(name, x)
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must be {what} = {tuple(expected)}, got {tuple(t.shape)}")
    return t


def check_chunk_size(chunk_size: object) -> int:
    """A positive int chunk size, else ``ValueError`` with the value."""
    return check_positive_int("chunk_size", chunk_size)


def token_mask(mask: object, b: int, l: int, like: Tensor) -> Tensor | None:
    """A ``[B, L]`` 1/0 or bool mask as a float tensor of ``like``'s dtype, or None.

    Raises:
        TypeError: not a tensor.
        ValueError: a shape other than ``(B, L)``.
    """
    if mask is None:
        return None
    m = check_tensor("mask", mask)
    if tuple(m.shape) != (b, l):
        raise ValueError(f"mask must be (batch, seq_len) = {(b, l)}, got {tuple(m.shape)}")
    return m.to(device=like.device, dtype=like.dtype if like.is_floating_point() else torch.float32)
