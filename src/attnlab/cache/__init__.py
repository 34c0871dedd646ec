"""KV caches: contiguous (static and growing), sliding-window, and cross-attention caches."""

from attnlab.cache.kv_cache import (
    CrossAttentionCache,
    DynamicKVCache,
    KVCache,
    ModelCache,
    SlidingWindowKVCache,
    StaticKVCache,
)

__all__ = [
    "CrossAttentionCache",
    "DynamicKVCache",
    "KVCache",
    "ModelCache",
    "SlidingWindowKVCache",
    "StaticKVCache",
]
