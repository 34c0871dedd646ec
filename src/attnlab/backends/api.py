"""The public attention call: validate once, choose a backend, run it.

:func:`scaled_dot_product_attention` is the entry users call, named at the package root
as ``attnlab.scaled_dot_product_attention`` (and ``attnlab.backends.scaled_dot_product_attention``).
It sits above the backends, so the reference math in :mod:`attnlab.functional` never
imports the layer that dispatches it.
"""

from __future__ import annotations

from torch import Tensor

from attnlab.backends.dispatch import dispatch
from attnlab.functional._checks import check_attention_inputs, check_mask_kind, check_positions
from attnlab.functional.attention import AttnMask
from attnlab.functional.masks import MaskPattern

__all__ = ["check_pattern_fits", "scaled_dot_product_attention"]


#: Signatures already validated: shapes, dtypes, devices and the scalar arguments
#: decide validity, so a repeated call (a decode loop) is checked once.
_VALID: set[tuple[object, ...]] = set()


def _check_once(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    enable_gqa: bool,
    dropout_p: float,
    scale: float | None,
) -> None:
    """:func:`check_attention_inputs`, remembered per signature (it depends on nothing else)."""
    hashable = type(dropout_p) in (int, float) and type(scale) in (int, float, type(None))
    if (
        hashable
        and isinstance(query, Tensor)
        and isinstance(key, Tensor)
        and isinstance(value, Tensor)
    ):
        sig = (
            query.shape,
            key.shape,
            value.shape,
            query.dtype,
            key.dtype,
            value.dtype,
            query.device,
            key.device,
            value.device,
            enable_gqa,
            type(dropout_p),
            dropout_p,
            type(scale),
            scale,
        )
        if sig in _VALID:
            return
    else:
        sig = None
    check_attention_inputs(
        query, key, value, enable_gqa=enable_gqa, dropout_p=dropout_p, scale=scale
    )
    if sig is not None:
        if len(_VALID) > 4096:
            _VALID.clear()
        _VALID.add(sig)


def check_pattern_fits(
    pattern: MaskPattern,
    query: Tensor,
    key: Tensor,
    q_positions: Tensor | None,
    k_positions: Tensor | None,
) -> None:
    """Refuse a pattern whose data (documents, padding, global tokens) does not fit the call."""
    L, S = query.shape[-2], key.shape[-2]
    q_end = int(q_positions.max()) + 1 if q_positions is not None and L else L
    k_end = int(k_positions.max()) + 1 if k_positions is not None and S else S
    pattern.check_fits(q_end, k_end)


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: AttnMask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    backend: str = "auto",
    return_weights: bool = False,
    q_positions: Tensor | None = None,
    k_positions: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention with torch's conventions and a safe fully-masked row.

    Follows :func:`torch.nn.functional.scaled_dot_product_attention`: ``(B, H, L, E)``
    layout (any number of leading batch dims), a bool mask is True where attention
    is allowed, a float mask is added to the scores, ``is_causal`` is aligned
    top-left, and ``enable_gqa`` shares each key/value head among
    ``H // H_kv`` query heads (Ainslie et al., 2023, "GQA").

    Differences from torch, on purpose:

    * a query row whose keys are all masked returns zeros (and zero weights),
      never NaN;
    * ``attn_mask`` may also be a :class:`~attnlab.functional.masks.MaskPattern`;
    * ``attn_mask`` and ``is_causal`` may be given together (their intersection);
    * float16/bfloat16 inputs compute the softmax in float32;
    * the call may say where its queries and keys sit (``q_positions``,
      ``k_positions``): patterns, ``is_causal`` and score modifiers are evaluated on
      those positions, so a cached decode step or a batch of rows of different
      lengths needs no dense mask (``docs/contracts.md``, section 1).

    Args:
        query: ``[B.., H, L, E]``.
        key: ``[B.., H_kv, S, E]``.
        value: ``[B.., H_kv, S, Ev]``.
        attn_mask: bool/float tensor broadcasting to ``[B.., H, L, S]``, or a pattern.
        dropout_p: dropout probability on the weights, applied whenever > 0 (as torch).
        is_causal: apply a causal mask (query ``i`` sees keys ``j <= i``).
        scale: score scale; default ``1/sqrt(E)`` (Vaswani et al., 2017).
        enable_gqa: allow ``H_kv < H`` with ``H % H_kv == 0``.
        backend: ``"auto"`` or a registered backend name (see :mod:`attnlab.backends`).
        return_weights: also return the attention weights ``[B.., H, L, S]``.
        q_positions: long ``[B or 1, L]``, each query's position (slot) in its row's
            sequence; default ``arange(L)``. ``B`` is the flattened batch.
        k_positions: long ``[B or 1, S]``, each key's position, ``-1`` for an empty
            entry (never attended); default ``arange(S)``.

    Returns:
        The output ``[B.., H, L, Ev]``, or ``(output, weights)`` with ``return_weights``.

    Raises:
        TypeError: non-tensors, non-floating or mixed dtypes, an integer mask.
        ValueError: shapes that do not fit, a bad head ratio, a bad ``dropout_p``
            or ``scale``, positions of the wrong shape or range, an unknown backend.
    """
    _check_once(query, key, value, enable_gqa, dropout_p, scale)
    check_mask_kind(attn_mask)
    if q_positions is not None or k_positions is not None:
        q_positions, k_positions = check_positions(q_positions, k_positions, query, key)
    if isinstance(attn_mask, MaskPattern):
        check_pattern_fits(attn_mask, query, key, q_positions, k_positions)
    out, weights = dispatch(
        query,
        key,
        value,
        attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        backend=backend,
        return_weights=return_weights,
        q_positions=q_positions,
        k_positions=k_positions,
    )
    if return_weights:
        assert weights is not None
        return out, weights
    return out
