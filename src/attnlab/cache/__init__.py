"""Caches, one protocol: what each layer carries between decoding steps (see :mod:`.base`).

KV caches (contiguous static and growing, sliding-window), cross-attention caches and the
model-level :class:`ModelCache` that holds per-layer caches of possibly different kinds.
"""

from attnlab.cache.base import CrossAttentionCache, KVCache, LayerCache, ModelCache
from attnlab.cache.kv_cache import DynamicKVCache, SlidingWindowKVCache, StaticKVCache

__all__ = [
    "CrossAttentionCache",
    "DynamicKVCache",
    "KVCache",
    "LayerCache",
    "ModelCache",
    "SlidingWindowKVCache",
    "StaticKVCache",
]
