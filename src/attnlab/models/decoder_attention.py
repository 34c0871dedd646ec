"""How one decoder forward attends: one :class:`AttentionPlan` per sliding window.

Shape notation: ``B`` batch, ``L`` new tokens, ``S`` keys attended to, ``D`` width.

The layers of one window share their attention: the pattern ``causal() &
sliding_window(W - 1) & padding(mask)`` with ALiBi and soft-capping as score modifiers,
evaluated on slots (the keys' slots from the first attention layer's cache of that
window), one :class:`~attnlab.backends.call.AttentionCall`, and the backend chosen once
for it. :class:`~attnlab.models.decoder.DecoderLM` builds the plans before its layers run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from attnlab.backends.call import AttentionCall
from attnlab.backends.plan import AttentionPlan, make_plan
from attnlab.backends.select import choose_call
from attnlab.cache.base import KVCache, ModelCache, Start
from attnlab.cache.kv_cache import DynamicKVCache
from attnlab.functional.masks import MaskPattern
from attnlab.models.decoder_parts import AttentionGroup, layer_pattern

if TYPE_CHECKING:
    from attnlab.models.decoder import DecoderLM

__all__ = [
    "attention_call",
    "attention_keys",
    "attention_pattern",
    "attention_plans",
    "explain",
    "first_kv",
]


def first_kv(
    cache: ModelCache | None, windows: tuple[int | None, ...], window: int | None
) -> KVCache | None:
    """The KV cache of the first attention layer of ``window``: its slots are those of
    every attention layer of that window (a rolling cache keeps the last ``W``)."""
    if cache is None:
        return None
    pairs = zip(cache.layers, windows)
    return next((c for c, w in pairs if isinstance(c, KVCache) and w == window), None)


def attention_plans(
    model: DecoderLM,
    x: Tensor,
    start: Start,
    mask: Tensor | None,
    positions: Tensor,
    q_slots: Tensor,
    cache: ModelCache | None,
    need_weights: bool,
    extra: MaskPattern | None,
    backend: str | None,
    key_slots: Tensor | None = None,
) -> dict[int | None, AttentionPlan]:
    """One plan per sliding window of the layers (None: global), each with its
    backend chosen once (or ``backend`` as resolved by the caller); ``key_slots``
    ``[1, S]``: a static cache's first ``S = start + L`` slots are the keys (see
    :func:`attention_pattern`)."""
    n = x.shape[1]
    # the new tokens' padding, for mixers whose state must skip pads (Mamba)
    token_mask = None if mask is None else mask.narrow(1, start, n)  # [B, L]
    plans: dict[int | None, AttentionPlan] = {}
    for window in dict.fromkeys(model.layer_windows):
        # the slots of the first attention layer of this window (others carry states)
        first = first_kv(cache, model.layer_windows, window)
        pattern, is_causal, q_pos, k_pos = attention_pattern(
            model, first, mask, start, n, q_slots, extra, window=window, key_slots=key_slots
        )
        s = attention_keys(first, n, k_pos, key_slots)
        call = attention_call(model, x, pattern, is_causal, s, need_weights, first)
        plans[window] = make_plan(
            call,
            backend=model.backend,
            chosen=backend,
            pattern=pattern,
            positions=positions,
            q_positions=q_pos,
            k_positions=k_pos,
            start=start,
            token_mask=token_mask,
        )
    return plans


def attention_keys(
    first: KVCache | None, n: int, k_pos: Tensor | None, key_slots: Tensor | None
) -> int:
    """``S``, the keys of the call: the pattern's key slots, the read prefix, or all."""
    if k_pos is not None:
        return k_pos.shape[-1]
    if key_slots is not None:
        return key_slots.shape[-1]
    return (first.length if first else 0) + n


def attention_pattern(
    model: DecoderLM,
    first: KVCache | None,
    mask: Tensor | None,
    start: Start,
    n: int,
    q_slots: Tensor,
    extra: MaskPattern | None = None,
    *,
    window: int | None,
    key_slots: Tensor | None = None,
) -> tuple[MaskPattern | None, bool, Tensor | None, Tensor | None]:
    """``(pattern, is_causal, q slots, k slots)`` shared by the layers of one window.

    The pattern is ``causal() & sliding_window(W - 1) & padding(mask)`` with ALiBi and
    soft-capping as score modifiers, evaluated on slots (and ``& extra``, a user's
    pattern such as ``document(ids)``, when given). Two shapes need no pattern at
    all: a prompt with no cache, padding, window or bias (torch's causal kernel), and
    one new token against a contiguous cache of every earlier slot (it sees them all).
    ``key_slots`` (``[1, S]``, ``S = start + n``: a compiled step that reads only the
    written prefix of a static cache) are the keys' slots; one new token sees them all.
    """
    mods = model._score_mods
    plain = mask is None and window is None and model._unscored and extra is None
    if key_slots is not None:
        if plain and n == 1:
            return None, False, None, None
        return layer_pattern(window, mask, extra, mods), False, q_slots, key_slots
    contiguous = first is None or isinstance(first, DynamicKVCache)
    if plain and contiguous and isinstance(start, int):
        if start == 0:
            return None, n > 1, None, None
        if n == 1:
            return None, False, None, None
    if first is not None:
        k_slots = first.key_slots(start, n, q_slots.device)  # [1, S]
    else:
        k_slots = torch.arange(q_slots.shape[-1] + int(start), device=q_slots.device)[None]
    return layer_pattern(window, mask, extra, mods), False, q_slots, k_slots


def attention_call(
    model: DecoderLM,
    x: Tensor,
    pattern: MaskPattern | None,
    is_causal: bool,
    s: int,
    need_weights: bool,
    first: KVCache | None = None,
) -> AttentionCall:
    """The one :class:`AttentionCall` every model-attention layer of this forward shares
    (``first``: the first layer's cache; a paged one gives the call its block size)."""
    c = model.decoder_config
    assert c.head_dim is not None and c.num_key_value_heads is not None
    b, n = x.shape[:2]
    training = model.training
    return AttentionCall(
        query_shape=(b, c.num_attention_heads, n, c.head_dim),
        key_shape=(b, c.num_key_value_heads, s, c.head_dim),
        value_shape=(b, c.num_key_value_heads, s, c.head_dim),
        dtype=x.dtype,
        device=x.device,
        mask="none" if pattern is None else "pattern",
        pattern=pattern,
        is_causal=is_causal,
        dropout_p=c.attention_dropout if training else 0.0,
        enable_gqa=c.num_key_value_heads != c.num_attention_heads,
        needs_grad=torch.is_grad_enabled()
        and (x.requires_grad or model._float_param().requires_grad),
        return_weights=need_weights,
        positions=pattern is not None,
        block_size=getattr(first, "block_size", 0) if pattern is not None else 0,
    )


def explain(
    model: DecoderLM, input_ids: Tensor, attention_mask: Tensor | None = None
) -> list[AttentionGroup]:
    """:meth:`DecoderLM.explain_attention`: one entry per distinct window of an uncached
    forward of ``input_ids`` (its layers, window, pattern and the registry's choice)."""
    b, n = input_ids.shape
    x = model._float_param().new_empty((b, n, model.decoder_config.hidden_size))  # shape and dtype
    mask = model._check_mask(attention_mask, b, n)
    q_slots = torch.arange(n, device=x.device)[None]
    plans = attention_plans(model, x, 0, mask, q_slots, q_slots, None, False, None, None)
    out = []
    for window, plan in plans.items():
        layers = tuple(i for i, w in enumerate(model.layer_windows) if w == window)
        pattern = plan.pattern
        shown = "causal (is_causal)" if pattern is None and plan.call.is_causal else repr(pattern)
        out.append(AttentionGroup(layers, window, shown, choose_call(plan.call, model.backend)))
    return out
