"""Input validation shared by the attention entry points.

Every check raises ``ValueError`` or ``TypeError`` with the offending values in
the message, so a user never meets a deep ``RuntimeError`` from a matmul.

Shape notation: ``B`` batch dims, ``H`` query heads, ``H_kv`` key/value heads,
``L`` query length, ``S`` key length, ``E`` query/key head dim, ``Ev`` value head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(name: str, x: object) -> Tensor:
    """Return ``x`` if it is a tensor, else raise ``TypeError`` naming ``name``."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is an int > 0 (not a bool), else raise ``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_probability(name: str, value: object) -> float:
    """Return ``value`` if it is a number in [0, 1), else raise ``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    return float(value)


def check_attention_inputs(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    enable_gqa: bool,
    dropout_p: float,
    scale: float | None,
) -> None:
    """Check query/key/value for ``scaled_dot_product_attention``.

    Raises:
        TypeError: a non-tensor, a non-floating dtype, or mixed dtypes.
        ValueError: ranks, batch dims, lengths, head dims or head counts that do not fit.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(name, t)
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            "query, key and value must share a dtype, got "
            f"{query.dtype}, {key.dtype}, {value.dtype}"
        )
    if not (query.device == key.device == value.device):
        raise ValueError(
            "query, key and value must be on one device, got "
            f"{query.device}, {key.device}, {value.device}"
        )
    if query.dim() < 3 or query.dim() != key.dim() or key.dim() != value.dim():
        raise ValueError(
            "query, key and value must have the same rank, at least 3 "
            "((B, L, E) or (B, H, L, E)), got shapes "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(
            f"key and value must have the same length, got key {tuple(key.shape)} "
            f"and value {tuple(value.shape)}"
        )
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"query and key must have the same head dim, got query {tuple(query.shape)} "
            f"(E={query.shape[-1]}) and key {tuple(key.shape)} (E={key.shape[-1]})"
        )
    if query.shape[:-3] != key.shape[:-3] or key.shape[:-3] != value.shape[:-3]:
        raise ValueError(
            "query, key and value must share their batch dims, got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if key.shape[-3] != value.shape[-3]:
        raise ValueError(
            f"key and value must have the same number of heads, got key {tuple(key.shape)} "
            f"and value {tuple(value.shape)}"
        )
    h_q, h_kv = query.shape[-3], key.shape[-3]
    if h_q != h_kv:
        if not enable_gqa:
            raise ValueError(
                f"query has {h_q} heads (dim -3) but key/value have {h_kv}; "
                "pass enable_gqa=True for grouped-query attention, or fix the shapes"
            )
        if query.dim() < 4:
            raise ValueError(
                f"enable_gqa needs (B, H, L, E) inputs, got query {tuple(query.shape)}"
            )
        if h_kv == 0 or h_q % h_kv != 0:
            raise ValueError(
                f"query heads ({h_q}) must be divisible by key/value heads ({h_kv}) for GQA"
            )
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if scale is not None and not scale > 0:
        raise ValueError(f"scale must be a positive number or None, got {scale}")


def check_dense_mask(attn_mask: object, target: tuple[int, ...]) -> Tensor:
    """Check a dense ``attn_mask`` broadcastable to ``target`` = (..., H, L, S).

    Raises:
        TypeError: not a tensor, or an integer dtype (ambiguous: 0/1 or additive?).
        ValueError: a shape that does not broadcast to ``target``.
    """
    mask = check_tensor("attn_mask", attn_mask)
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(
            f"attn_mask must be bool (True = attend) or floating (added to the scores), "
            f"got {mask.dtype}; for an HF-style 1/0 mask use "
            "attnlab.functional.masks.padding_mask(attention_mask)"
        )
    try:
        shape = torch.broadcast_shapes(tuple(mask.shape), target)
    except RuntimeError:
        shape = None
    if shape != torch.Size(target):
        raise ValueError(
            f"attn_mask of shape {tuple(mask.shape)} does not broadcast to the "
            f"attention scores' shape {target} (batch..., heads, query len, key len)"
        )
    return mask


def check_positions(
    q_positions: object, k_positions: object, query: Tensor, key: Tensor
) -> tuple[Tensor | None, Tensor | None]:
    """Check the query/key positions of an attention call (``docs/contracts.md``, section 1).

    ``q_positions`` is ``[B or 1, L]`` and ``k_positions`` ``[B or 1, S]``, integer, on
    the inputs' device, where ``B`` is the flattened batch (the product of the dims
    before the heads; 1 for 3-D inputs). Query positions are ``>= 0``; a key position
    is ``>= 0``, or ``-1`` for an empty entry.

    Returns:
        The positions as long tensors (None stays None).

    Raises:
        TypeError: not a tensor, or not an integer dtype.
        ValueError: a wrong shape, device, or a value out of range.
    """
    batch = 1
    for d in query.shape[:-3]:
        batch *= d
    out: list[Tensor | None] = []
    for name, pos, n, lowest in (
        ("q_positions", q_positions, query.shape[-2], 0),
        ("k_positions", k_positions, key.shape[-2], -1),
    ):
        if pos is None:
            out.append(None)
            continue
        t = check_tensor(name, pos)
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor (long), got {t.dtype}")
        if t.dim() != 2 or t.shape[1] != n or t.shape[0] not in (1, batch):
            raise ValueError(
                f"{name} must have shape [{batch} or 1, {n}] (batch, "
                f"{'query' if lowest == 0 else 'key'} length), got {tuple(t.shape)}"
            )
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, the inputs on {query.device}")
        if t.numel() and int(t.min()) < lowest:
            raise ValueError(
                f"{name} must be >= {lowest}"
                + (" (-1 marks an empty key)" if lowest < 0 else "")
                + f", got a minimum of {int(t.min())}"
            )
        out.append(t.long())
    return out[0], out[1]
