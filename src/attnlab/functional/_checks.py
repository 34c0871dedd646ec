"""Input validation shared by the attention entry points.

Every check raises ``ValueError`` or ``TypeError`` with the offending values in
the message, so a user never meets a deep ``RuntimeError`` from a matmul.

Shape notation: ``B`` batch dims, ``H`` query heads, ``H_kv`` key/value heads,
``L`` query length, ``S`` key length, ``E`` query/key head dim, ``Ev`` value head dim.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnlab._validate import check_int, check_positive_int, check_probability, check_real
from attnlab.errors import NonFiniteError

__all__ = [
    "check_attention_inputs",
    "check_binary_mask",
    "check_dense_mask",
    "check_finite_logits",
    "check_index_range",
    "check_int",
    "check_integer_tensor",
    "check_mask_kind",
    "check_positive_int",
    "check_probability",
    "check_real",
    "check_scale",
    "check_tensor",
    "check_token_ids",
    "refuse_nonfinite_max",
]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(name: str, x: object) -> Tensor:
    """Return ``x`` if it is a tensor, else raise ``TypeError`` naming ``name``."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_scale(value: object) -> float | None:
    """The ``scale`` of an attention call: None (``1/sqrt(E)``) or a finite number > 0."""
    if value is None:
        return None
    return check_real("scale", value, gt=0.0)


def check_binary_mask(name: str, mask: object, shape: tuple[int, ...] | None = None) -> Tensor:
    """Check a Hugging Face-style ``attention_mask``: 1 (token) / 0 (padding), ``(B, T)``.

    The one check every model and ``generate`` apply to their ``attention_mask``. Any
    bool, integer or floating dtype is accepted as long as the values are 0 and 1; an
    additive float mask (0 / ``-inf``) is refused with a pointer to ``attn_mask``.

    Args:
        name: the argument's name, for the message.
        mask: the mask.
        shape: the expected ``(B, T)``, or None to check only the rank.

    Returns:
        ``mask`` unchanged.

    Raises:
        TypeError: not a tensor.
        ValueError: not 2-D, a shape other than ``shape``, or values other than 0 and 1.
    """
    m = check_tensor(name, mask)
    if m.dim() != 2 or (shape is not None and tuple(m.shape) != tuple(shape)):
        want = f"(batch, seq_len) = {tuple(shape)}" if shape is not None else "(batch, seq_len)"
        raise ValueError(f"{name} must be {want} of 1/0, got shape {tuple(m.shape)}")
    if m.dtype != torch.bool:
        bad = (m != 0) & (m != 1)  # NaN compares unequal to both: refused too
        if bool(bad.any()):
            values = torch.unique(m[bad])[:5].tolist()
            raise ValueError(
                f"{name} must hold only 1 (token) and 0 (padding), found {values}; an additive "
                "float mask (0 / -inf) goes to attn_mask instead"
            )
    return m


def check_integer_tensor(name: str, x: object) -> Tensor:
    """Return ``x`` if it is a tensor of an integer dtype (not bool), else raise naming it.

    Raises:
        TypeError: not a tensor, or a floating, complex or bool dtype.
    """
    t = check_tensor(name, x)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    return t


def check_index_range(name: str, t: Tensor, upper: int, *, bound: str | None = None) -> Tensor:
    """Return ``t`` if its values lie in ``[0, upper)``; ``bound`` names ``upper`` in the message.

    Raises:
        ValueError: a value outside the range; the message gives the range of values found.
    """
    if t.numel():
        lo, hi = torch.aminmax(t)
        if int(lo) < 0 or int(hi) >= upper:
            limit = f"{bound}={upper}" if bound else str(upper)
            raise ValueError(
                f"{name} must be in [0, {limit}), got values in [{int(lo)}, {int(hi)}]"
            )
    return t


def check_token_ids(name: str, ids: object, vocab_size: int) -> Tensor:
    """Check token ids given to a model: an integer ``(B, S)`` tensor, ``B, S > 0``, in range.

    Raises:
        TypeError: not a tensor, or not an integer dtype.
        ValueError: not 2-D, no tokens (``B`` or ``S`` is 0), or ids outside ``[0, vocab_size)``.
    """
    t = check_integer_tensor(name, ids)
    if t.dim() != 2:
        raise ValueError(f"{name} must be (batch, seq_len), got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(
            f"{name} holds no tokens (shape {tuple(t.shape)}); a model needs at least one "
            "token per row"
        )
    return check_index_range(name, t, vocab_size, bound="vocab_size")


def check_finite_logits(logits: Tensor, *, step: int) -> None:
    """Refuse logits a token cannot be chosen from: NaN, ``+inf``, or a row all ``-inf``.

    One reduction over the vocabulary and one host sync, run once per decoding step
    outside any compiled region. ``-inf`` entries alone are fine (masked tokens).

    Args:
        logits: ``[B, V]`` of one step.
        step: the step (0 = the token after the prompt), named in the message.

    Raises:
        NonFiniteError: the message names the step, the rows and what was found.
    """
    refuse_nonfinite_max(logits.amax(dim=-1), step=step)


def refuse_nonfinite_max(top: Tensor, *, step: int) -> None:
    """:func:`check_finite_logits` given the rows' maxima ``top [B]`` (NaN and ``+inf``
    propagate through a max, an all ``-inf`` row stays ``-inf``): one host sync."""
    bad = ~torch.isfinite(top)
    if bool(bad.any()):
        rows = bad.nonzero().flatten()[:8].tolist()
        found = sorted({"NaN" if math.isnan(v) else str(v) for v in top[bad].tolist()})
        raise NonFiniteError(
            f"decoding step {step}: the logits of row(s) {rows} hold no finite maximum "
            f"(found {', '.join(found)}), so no token can be chosen; the model computed "
            "non-finite values (check its weights or run attnlab.analysis.diagnose on it)"
        )


def check_mask_kind(attn_mask: object) -> None:
    """``attn_mask`` is None, a tensor or a mask pattern (checked before anything reads it).

    Raises:
        TypeError: anything else (a Python list, a numpy array), naming what was given.
    """
    from attnlab.functional.masks import MaskPattern

    if attn_mask is not None and not isinstance(attn_mask, Tensor | MaskPattern):
        raise TypeError(
            "attn_mask must be None, a torch.Tensor (bool: True = attend; float: added to the "
            f"scores) or a mask pattern (attnlab.functional.masks), got {type(attn_mask).__name__}"
        )


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
    check_probability("dropout_p", dropout_p)
    check_scale(scale)


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
        t = check_integer_tensor(name, pos)
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
