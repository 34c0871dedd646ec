"""Paged KV cache (PagedAttention, Kwon et al., 2023): blocks, tables, prefix cache, forks."""

from attnlab.cache.paged.allocator import BlockAllocator, OutOfBlocks, block_hash
from attnlab.cache.paged.cache import PagedKVCache
from attnlab.cache.paged.pool import PagedKVPool, StepBatch

__all__ = [
    "BlockAllocator",
    "OutOfBlocks",
    "PagedKVCache",
    "PagedKVPool",
    "StepBatch",
    "block_hash",
]
