"""Dense masks: tensors that broadcast to the scores' shape ``(B, H, L, S)``.

A boolean mask is ``True`` where a query may attend to a key; a floating mask is added
to the scores (the conventions of ``torch.nn.functional.scaled_dot_product_attention``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from attnlab.counting import INT64_MAX
from attnlab.functional._checks import check_binary_mask, check_int, check_tensor

__all__ = ["causal_mask", "combine", "lengths_mask", "padding_mask"]


def _check_len(name: str, n: object, *, min_value: int = 0) -> int:
    """Return ``n`` if it is an int in ``[min_value, 2**63 - 1]``; raise naming ``name`` otherwise."""
    value = check_int(name, n, min_value=min_value)
    if value > INT64_MAX:
        raise ValueError(f"{name} must fit in int64 (<= {INT64_MAX}), got {value}")
    return value


def causal_mask(
    q_len: int,
    kv_len: int | None = None,
    *,
    offset: int = 0,
    device: torch.device | str | None = None,
) -> Tensor:
    """Dense causal mask of shape ``(q_len, kv_len)``: query ``i`` sees keys ``j <= i + offset``.

    Args:
        q_len: number of queries ``L``.
        kv_len: number of keys ``S`` (default ``q_len``).
        offset: position of the first query among the keys. ``0`` is torch's
            ``is_causal`` (top-left); ``kv_len - q_len`` is the alignment of
            cached decoding (bottom-right).
        device: where to build the mask.

    Returns:
        Bool tensor ``(L, S)``, True = attend.
    """
    kv_len = q_len if kv_len is None else kv_len
    _check_len("q_len", q_len)
    _check_len("kv_len", kv_len)
    check_int("offset", offset)
    q = torch.arange(q_len, device=device).unsqueeze(-1) + offset  # [L, 1]
    k = torch.arange(kv_len, device=device).unsqueeze(0)  # [1, S]
    return k <= q


def padding_mask(attention_mask: Tensor) -> Tensor:
    """Key-padding mask from a Hugging Face-style ``attention_mask``.

    Args:
        attention_mask: ``(B, S)`` of 1 (token) and 0 (padding), any integer,
            bool or float dtype.

    Returns:
        Bool tensor ``(B, 1, 1, S)``, True at real tokens; broadcasts over heads
        and queries.

    Raises:
        TypeError: not a tensor.
        ValueError: not 2-D, or values other than 0 and 1.
    """
    # A compiled step (no host sync allowed) gets a mask its caller validated on entry.
    if not torch.compiler.is_compiling():
        check_binary_mask("attention_mask", attention_mask)
    return attention_mask.bool()[:, None, None, :]


def lengths_mask(lengths: Tensor | Sequence[int], max_len: int | None = None) -> Tensor:
    """Key-padding mask from sequence lengths (right padding).

    Args:
        lengths: ``(B,)`` number of real tokens per sequence.
        max_len: padded length ``S`` (default: the largest length).

    Returns:
        Bool tensor ``(B, 1, 1, S)``, True at the first ``lengths[b]`` positions.
    """
    lens = torch.as_tensor(lengths)
    if lens.dim() != 1 or lens.dtype.is_floating_point or lens.dtype == torch.bool:
        raise ValueError(
            f"lengths must be a 1-D integer sequence, got {lens.dtype} {tuple(lens.shape)}"
        )
    if lens.numel() and int(lens.min()) < 0:
        raise ValueError(f"lengths must be >= 0, got {lens.tolist()}")
    longest = int(lens.max()) if lens.numel() else 0
    max_len = longest if max_len is None else _check_len("max_len", max_len)
    if longest > max_len:
        raise ValueError(f"a length ({longest}) exceeds max_len ({max_len})")
    pos = torch.arange(max_len, device=lens.device)
    return (pos[None, :] < lens[:, None])[:, None, None, :]


def combine(*masks: Tensor | None) -> Tensor | None:
    """Combine dense masks, broadcasting their shapes.

    Bool masks are intersected (a pair is attended only if every mask allows it).
    If any mask is floating, the result is additive: bool masks become ``0``/``-inf``
    and all are summed. ``None`` entries are skipped; all ``None`` gives ``None``.
    """
    present = [check_tensor("mask", m) for m in masks if m is not None]
    if not present:
        return None
    float_masks = [m for m in present if m.dtype.is_floating_point]
    if not float_masks:
        out = present[0]
        for m in present[1:]:
            out = out & m
        return out
    dtype = torch.promote_types(float_masks[0].dtype, torch.float32)
    for m in float_masks[1:]:
        dtype = torch.promote_types(dtype, m.dtype)
    total: Tensor | None = None
    for m in present:
        add = m.to(dtype) if m.dtype.is_floating_point else _bool_to_additive(m, dtype)
        total = add if total is None else total + add
    return total


def _bool_to_additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        ~mask, float("-inf")
    )
