"""The ``reference`` backend: the math in :mod:`attnlab.functional`, runs every call."""

from __future__ import annotations

from torch import Tensor

from attnlab.backend_traits import TRAITS
from attnlab.backends.call import AttentionCall, Backend
from attnlab.backends.cost_model import Estimate, estimate
from attnlab.backends.registry import register
from attnlab.functional.attention import empty_attention, resolve_mask, sdpa_reference
from attnlab.functional.masks import MaskPattern


def reference_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | MaskPattern | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    return_weights: bool = False,
    q_positions: Tensor | None = None,
    k_positions: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """:func:`attnlab.functional.sdpa_reference`, taking a pattern and its score modifiers too.

    The pattern is evaluated at the call's positions (``q_positions`` ``[B|1, L]``,
    ``k_positions`` ``[B|1, S]``, ``-1`` = empty key; default ``arange``).
    """
    if query.shape[-2] == 0 or key.shape[-2] == 0:
        return empty_attention(query, key, value, return_weights=return_weights)
    mods: tuple = ()
    if isinstance(attn_mask, MaskPattern):
        mods = attn_mask.score_mods
        for m in mods:
            m.check_heads(query.shape[-3])
        target = (*query.shape[:-1], key.shape[-2])  # [B.., H, L, S]
        attn_mask = resolve_mask(
            attn_mask._unscored(),
            target,
            device=query.device,
            q_positions=q_positions,
            k_positions=k_positions,
        )
    return sdpa_reference(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        return_weights=return_weights,
        score_mods=mods,
        q_positions=q_positions,
        k_positions=k_positions,
    )


def _check(call: AttentionCall) -> str | None:
    return None


def _cost(call: AttentionCall) -> Estimate | None:
    return estimate("reference", call, call.query_shape[-2] * call.key_shape[-2])


REFERENCE = register(
    Backend(
        fn=reference_attention,
        check=_check,
        cost=_cost,
        **TRAITS["reference"].registry_fields(),
    )
)
