"""KV caches: contiguous (static and growing), sliding-window, paged, and cross-attention caches."""

from attnlab.cache.kv_cache import (
    CrossAttentionCache,
    DynamicKVCache,
    KVCache,
    ModelCache,
    SlidingWindowKVCache,
    StaticKVCache,
)
from attnlab.cache.paged import BlockAllocator, OutOfBlocks, PagedKVCache, PagedKVPool

__all__ = [
    "BlockAllocator",
    "CrossAttentionCache",
    "DynamicKVCache",
    "KVCache",
    "ModelCache",
    "OutOfBlocks",
    "PagedKVCache",
    "PagedKVPool",
    "SlidingWindowKVCache",
    "StaticKVCache",
]
