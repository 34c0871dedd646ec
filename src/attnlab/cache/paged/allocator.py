"""The block allocator of a paged KV cache: free list, reference counts, prefix cache, LRU.

PagedAttention (Kwon et al., 2023, "Efficient Memory Management for Large Language
Model Serving with PagedAttention") stores the keys/values of a sequence in fixed-size
*blocks* of ``block_size`` tokens taken from one preallocated pool, so memory is
allocated a block at a time as a sequence grows instead of for its maximum length.

This module keeps the book-keeping only (block ids, never tensors):

* a **free list** of blocks that hold nothing worth keeping;
* a **reference count** per block: the number of sequences whose block table holds it
  (a block shared by a fork or by a prefix hit has a count above one);
* a **prefix cache**: a full block may be registered under the hash of its content
  (chained with the hash of the block before it, so equal hashes mean equal prefixes);
  a later sequence whose prompt hashes the same takes the block instead of recomputing
  it (vLLM's automatic prefix caching);
* an **LRU list** of registered blocks that no sequence holds any more: they keep their
  content for future hits and are evicted, least recently released first, only when the
  free list is empty.

Every block is in exactly one of three states: *free* (on the free list), *held*
(reference count > 0), or *evictable* (count 0, registered, on the LRU list).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence

from attnlab.functional._checks import check_int, check_positive_int

__all__ = ["BlockAllocator", "OutOfBlocks", "block_hash"]


class OutOfBlocks(RuntimeError):
    """No free or evictable block is left (the caller should preempt a sequence)."""


def block_hash(previous: bytes | None, tokens: Sequence[int]) -> bytes:
    """The content hash of a full block: BLAKE2b over the previous block's hash and the tokens.

    Chaining makes a block's hash name its whole prefix: two blocks with equal hashes
    hold the same tokens after the same prefix, hence the same keys/values.

    Args:
        previous: the hash of the block before (None for the first block).
        tokens: the token ids in the block.

    Returns:
        A 16-byte digest.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(previous or b"\x00" * 16)
    h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens))
    return h.digest()


class BlockAllocator:
    """Block ids ``0 .. num_blocks-1`` with reference counts and a content-hash prefix cache.

    Args:
        num_blocks: blocks in the pool.

    Raises:
        ValueError: ``num_blocks`` not a positive int.
    """

    def __init__(self, *, num_blocks: int) -> None:
        check_positive_int("num_blocks", num_blocks)
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self.hits = 0  # prefix-cache lookups that found a block
        self.queries = 0  # prefix-cache lookups
        self.evictions = 0

    # ------------------------------------------------------------------ counts

    @property
    def num_free(self) -> int:
        """Blocks an :meth:`allocate` can return now (free + evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_held(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - self.num_free

    @property
    def num_evictable(self) -> int:
        """Unreferenced blocks kept for prefix hits."""
        return len(self._evictable)

    def _block(self, block: object) -> int:
        """``block`` if it is a block id (an int, not a bool, in ``[0, num_blocks)``): a
        negative index would reach another block through Python's indexing."""
        return check_int("block", block, min_value=0, max_value=self.num_blocks - 1)

    def refcount(self, block: int) -> int:
        """How many holders ``block`` has."""
        return self._refs[self._block(block)]

    def is_cached(self, block: int) -> bool:
        """Whether ``block`` is registered in the prefix cache."""
        return self._hash[self._block(block)] is not None

    # ------------------------------------------------------------------ operations

    def allocate(self) -> int:
        """Take a block (reference count 1): from the free list, else evict the LRU cached one.

        Raises:
            OutOfBlocks: every block is held.
        """
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            h = self._hash[block]
            assert h is not None
            del self._cached[h]
            self._hash[block] = None
            self.evictions += 1
        else:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are in use")
        assert self._refs[block] == 0
        self._refs[block] = 1
        return block

    def incref(self, block: int) -> None:
        """Add a holder to a held or evictable block (a fork, or a prefix hit)."""
        block = self._block(block)
        if self._refs[block] == 0:
            if block not in self._evictable:
                raise ValueError(f"block {block} is free: it has no content to share")
            del self._evictable[block]
        self._refs[block] += 1

    def release(self, block: int) -> None:
        """Drop a holder; at zero the block becomes evictable if registered, else free."""
        block = self._block(block)
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is not held (reference count 0)")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if self._hash[block] is not None:
                self._evictable[block] = None  # most recently released last
            else:
                self._free.append(block)

    def lookup(self, h: bytes) -> int | None:
        """The block registered under hash ``h``, now held once more; None on a miss."""
        self.queries += 1
        block = self._cached.get(h)
        if block is None:
            return None
        self.hits += 1
        self.incref(block)
        return block

    def register(self, block: int, h: bytes) -> bool:
        """Register a full, held block under its content hash ``h``.

        Returns:
            False when another block already holds that content (nothing changes).
        """
        block = self._block(block)
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is not held; only held blocks can be registered")
        if h in self._cached or self._hash[block] is not None:
            return False
        self._cached[h] = block
        self._hash[block] = h
        return True

    def evict_all(self) -> int:
        """Move every evictable block to the free list (drops the prefix cache). Returns the count."""
        n = len(self._evictable)
        while self._evictable:
            block, _ = self._evictable.popitem(last=False)
            h = self._hash[block]
            assert h is not None
            del self._cached[h]
            self._hash[block] = None
            self._free.append(block)
        self.evictions += n
        return n

    def check(self) -> None:
        """Assert the internal invariants (every block in exactly one state); for tests."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is twice on the free list"
        evictable = set(self._evictable)
        held = {b for b in range(self.num_blocks) if self._refs[b] > 0}
        assert not (free & evictable) and not (free & held) and not (evictable & held)
        assert len(free) + len(evictable) + len(held) == self.num_blocks, "a block was lost"
        assert all(self._refs[b] >= 0 for b in range(self.num_blocks))
        for b in evictable:
            assert self._hash[b] is not None
        for h, b in self._cached.items():
            assert self._hash[b] == h
        assert sum(h is not None for h in self._hash) == len(self._cached)
