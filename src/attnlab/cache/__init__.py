"""Caches, one protocol: what each layer carries between decoding steps (see :mod:`.base`).

KV caches (contiguous static and growing, sliding-window, paged), cross-attention caches
and the model-level :class:`ModelCache` that holds per-layer caches of possibly different
kinds.
"""

from attnlab.cache.base import CrossAttentionCache, KVCache, LayerCache, ModelCache
from attnlab.cache.kv_cache import DynamicKVCache, SlidingWindowKVCache, StaticKVCache
from attnlab.cache.paged import BlockAllocator, OutOfBlocks, PagedKVCache, PagedKVPool
from attnlab.cache.sink import SinkKVCache

__all__ = [
    "BlockAllocator",
    "CrossAttentionCache",
    "DynamicKVCache",
    "KVCache",
    "LayerCache",
    "ModelCache",
    "OutOfBlocks",
    "PagedKVCache",
    "PagedKVPool",
    "SinkKVCache",
    "SlidingWindowKVCache",
    "StaticKVCache",
]
