"""The self-attention of the cost model, one group of layers per window.

Shape notation as in :mod:`attnlab.analysis.cost`. A model's layers usually share one
attention shape; a layout that mixes windows (Gemma 2's alternate local and global
layers, Gemma 3's five local to one global, ModernBERT's every third global) has one
:class:`LayerGroup` per window, each with its own shape, backend and KV-cache slots.

* :func:`self_attention`: one layer's shape (its mask's density in closed form) and the
  slots its KV cache allocates;
* :func:`auto_backend`: the backend the registry's ``auto`` runs for that shape;
* :func:`group_label`: how reports name a group.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from attnlab.analysis.arch import ArchSpec
from attnlab.analysis.backend_choice import auto_choice
from attnlab.analysis.cost_layers import (
    BackendTraits,
    LayerShape,
    causal_density,
    dynamic_slots,
    window_density,
)
from attnlab.counting import band_pairs

__all__ = ["LayerGroup", "auto_backend", "group_label", "self_attention"]


def auto_backend(
    requested: str,
    spec: ArchSpec,
    shape: LayerShape,
    *,
    mode: str,
    dtype: str,
    mask: Any,
) -> str:
    """The backend ``auto`` would choose for this model's self-attention calls.

    A backend named, or set with ``attnlab.backends.use``, wins (costed as asked).
    Otherwise the registry decides (:func:`attnlab.analysis.backend_choice.auto_choice`):
    its checks and its calibrated cost model, the same that run a real call.
    """
    if requested != "auto":
        return requested
    registry = sys.modules.get("attnlab.backends.registry")
    if registry is not None and registry.current() != "auto":
        return str(registry.current())
    why = auto_choice(
        batch_size=shape.b,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        q_len=shape.lq,
        kv_len=shape.s,
        dtype=dtype,
        training=mode == "training",
        causal=shape.causal,
        window=shape.window,
        two_sided=shape.two_sided,
        mask=mask,
        dense_mask=not shape.structured and mask is None,
        positions=mode == "decode",
    )
    return why.chosen


@dataclass
class LayerGroup:
    """Layers that share one window (all layers, unless the layout mixes windows)."""

    spec: ArchSpec  # the group's layers: its window, ``num_layers`` of them
    shape: LayerShape
    cache_slots: int  # slots its KV cache allocates per sequence (decode)
    backend: str
    traits: BackendTraits

    @property
    def count(self) -> int:
        return self.spec.num_layers


def self_attention(
    spec: ArchSpec,
    *,
    batch_size: int,
    self_len: int,
    decode: bool,
    new_tokens: int,
    cache: str,
    cache_capacity: int | None,
    mask: Any,
) -> tuple[LayerShape, int]:
    """One layer's self-attention shape (density included) and its cache's slots.

    A causal ``spec.window`` sees the last ``W`` keys; a bidirectional one ``W // 2`` on
    each side.
    """
    lq = new_tokens if decode else self_len
    context = self_len + new_tokens if decode else self_len
    q_offset = context - lq
    # keys the attention runs over (stored) and slots the cache allocates (cache_slots)
    stored = cache_slots = context
    if decode:
        if cache == "static":
            cap = cache_capacity if cache_capacity is not None else context
            if cap < context:
                raise ValueError(
                    f"cache_capacity ({cap}) is smaller than the context ({context} tokens)"
                )
            stored = cache_slots = cap  # StaticKVCache returns its whole buffer
        elif cache == "sliding" and spec.window is not None:
            # SlidingWindowKVCache keeps the last W slots and appends the new ones to them
            stored = cache_slots = min(self_len, spec.window) + lq
        else:  # dynamic (a global layer of a mixed layout keeps a growing cache)
            capacity = context if cache_capacity is None else cache_capacity
            cache_slots = dynamic_slots(self_len, lq, capacity)
    two_sided = spec.window is not None and not spec.causal
    if mask is not None:
        density = float(mask.density(lq, context, q_offset=q_offset))
    elif two_sided:
        assert spec.window is not None
        half = spec.window // 2
        density = band_pairs(half, half, 0, lq - 1, 0, context - 1) / (lq * context)
    elif spec.window is not None:
        density = window_density(spec.window, lq, context, q_offset)
    elif spec.causal:
        density = causal_density(lq, context, q_offset)
    else:
        density = 1.0
    if spec.pattern_density is not None and mask is None:
        density = min(density, spec.pattern_density)
    if stored != context:
        density *= context / stored  # the same attended pairs, over the keys returned
    shape = LayerShape(
        b=batch_size,
        lq=lq,
        s=stored,
        density=density,
        causal=spec.causal or (spec.window is not None and not two_sided),
        window=spec.window,
        two_sided=two_sided,
        q_offset=q_offset,
        structured=mask is None and spec.pattern_density is None,
    )
    return shape, cache_slots


def group_label(g: LayerGroup) -> str:
    w = g.spec.window
    if w is None:
        return "global layers"
    return f"local layers (window {w}{', two-sided' if not g.spec.causal else ''})"
