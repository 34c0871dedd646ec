"""The KV manager: which blocks hold which sequence's tokens, without a tensor.

The book-keeping of a paged KV cache (PagedAttention, Kwon et al., 2023): one *block
table* per sequence (its blocks in order: token ``p`` lives in block ``table[p // bs]``
at offset ``p % bs``), the tokens it knows and how many of them are computed (their
keys/values stored) or reserved (given slots), the chained hashes of its full blocks
for the prefix cache, and the :class:`~attnlab.cache.paged.allocator.BlockAllocator`'s
reference counts. Torch-free: the tensors live in
:class:`~attnlab.cache.paged.storage.KVStorage`, and the only thing the manager asks of
them is the block copies that copy-on-write needs, which :meth:`KVManager.reserve`
returns for the caller to perform (vLLM's ``KVCacheManager`` returns its blocks "to hide
the internal data structure" the same way).

Copy-on-write: a block held by several sequences (a fork) is never written; a sequence
that must write into a shared, partially filled block first gets a copy of its own.
Full blocks are never written again, so they are shared freely, and they are
registered in the prefix cache under their chained content hash.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from attnlab._validate import check_int, check_positive_int
from attnlab.cache.paged.allocator import BlockAllocator, OutOfBlocks, block_hash

__all__ = ["FREED", "KVManager", "OutOfBlocks", "SeqId"]

SeqId = Hashable

#: A block-table entry whose block was freed (wholly outside the sliding window).
FREED = -1


@dataclass
class _Sequence:
    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # known token ids (stored or pending)
    computed: int = 0  # tokens whose keys/values are stored
    reserved: int = 0  # tokens that have slots (>= computed)
    hashes: list[bytes] = field(default_factory=list)  # hashes of the leading full blocks
    hashable: bool = True  # token ids are known (False for rows of a plain generate)
    first_live: int = 0  # leading blocks freed behind a sliding window (entries are FREED)


def _token_ids(name: str, tokens: Sequence[int]) -> list[int]:
    """``tokens`` as a list of ints >= 0; a float, a bool or a negative id is refused
    (``int(1.7)`` would silently make it token 1)."""
    return [check_int(f"{name}[{i}]", t, min_value=0) for i, t in enumerate(tokens)]


class KVManager:
    """Block tables, prefix cache and reference counts of many sequences.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block (vLLM's default is 16).
        prefix_caching: register full blocks by content hash and reuse them.
        sliding_window: the window ``W`` every attention layer shares (a query at ``p``
            sees keys ``p - W + 1 .. p``), or None: after each step, a sequence's blocks
            wholly before its next query's window are returned to the pool.

    Raises:
        ValueError: a size that is not a positive int.
    """

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int = 16,
        prefix_caching: bool = True,
        sliding_window: int | None = None,
    ) -> None:
        check_positive_int("num_blocks", num_blocks)
        check_positive_int("block_size", block_size)
        if sliding_window is not None:
            check_positive_int("sliding_window", sliding_window)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.sliding_window = sliding_window
        self.allocator = BlockAllocator(num_blocks=num_blocks)
        self.seqs: dict[SeqId, _Sequence] = {}
        self.copies = 0  # copy-on-write block copies

    # ------------------------------------------------------------------ sizes

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (free + evictable prefix-cache blocks)."""
        return self.allocator.num_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.allocator.num_held

    def stored_slots(self) -> int:
        """Token slots of held blocks that hold a token (a shared block is counted once).

        Every held block is full but the tail blocks of a sequence (from its computed
        tokens on); a block shared by several sequences holds as many tokens for each
        (a holder that writes into a shared block copies it first, and only full blocks
        are shared through the prefix cache). So only the tails are visited: the cost
        grows with the sequences, not with their lengths (this runs every engine step).
        """
        bs = self.block_size
        tails: dict[int, int] = {}
        for s in self.seqs.values():
            for i in range(max(s.computed // bs, s.first_live), len(s.blocks)):
                blk = s.blocks[i]
                n = max(0, s.computed - i * bs)  # < bs: the block is not full
                if blk != FREED and n >= tails.get(blk, 0):
                    tails[blk] = n
        return (self.num_used_blocks - len(tails)) * bs + sum(tails.values())

    def waste(self) -> float:
        """Allocated slots holding no token / allocated slots (0 when nothing is allocated)."""
        held = self.num_used_blocks * self.block_size
        return 0.0 if held == 0 else 1.0 - self.stored_slots() / held

    # ------------------------------------------------------------------ sequences

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self.seqs

    def _seq(self, seq_id: SeqId) -> _Sequence:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise ValueError(f"unknown sequence {seq_id!r}") from None

    def add_sequence(self, seq_id: SeqId, tokens: Sequence[int]) -> int:
        """Start a sequence whose known tokens are ``tokens`` (its prompt).

        With prefix caching, the leading full blocks whose chained hash is registered are
        taken from the cache; at least the last token is left to compute (its logits
        are needed).

        Returns:
            The number of tokens already computed (prefix-cache hits), a multiple of
            ``block_size``.

        Raises:
            ValueError: ``seq_id`` exists, or ``tokens`` is empty.
        """
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        if len(tokens) == 0:
            raise ValueError("a sequence needs at least one token")
        s = _Sequence(tokens=_token_ids("tokens", tokens))
        self.seqs[seq_id] = s
        if self.prefix_caching:
            bs = self.block_size
            for i in range((len(s.tokens) - 1) // bs):
                h = block_hash(s.hashes[-1] if s.hashes else None, s.tokens[i * bs : (i + 1) * bs])
                blk = self.allocator.lookup(h)
                if blk is None:
                    break
                s.blocks.append(blk)
                s.hashes.append(h)
            s.computed = s.reserved = len(s.blocks) * bs
        return s.computed

    def append_tokens(self, seq_id: SeqId, tokens: Sequence[int]) -> None:
        """Add known tokens (e.g. the one just sampled) to be computed by a later step."""
        s = self._seq(seq_id)
        s.tokens.extend(_token_ids("tokens", tokens))

    def num_tokens(self, seq_id: SeqId) -> int:
        """Known tokens of a sequence."""
        return len(self._seq(seq_id).tokens)

    def num_computed(self, seq_id: SeqId) -> int:
        """Tokens of a sequence whose keys/values are stored."""
        return self._seq(seq_id).computed

    def block_table(self, seq_id: SeqId) -> list[int]:
        """A copy of the sequence's block table."""
        return list(self._seq(seq_id).blocks)

    def blocks_needed(self, seq_id: SeqId, num_new: int) -> int:
        """Blocks :meth:`reserve` would allocate for ``num_new`` more tokens (copy-on-write included)."""
        s = self._seq(seq_id)
        check_int("num_new", num_new, min_value=0)
        bs = self.block_size
        need = -(-(s.reserved + num_new) // bs) - len(s.blocks)
        if num_new > 0 and s.reserved % bs and self.allocator.refcount(s.blocks[-1]) > 1:
            need += 1  # the shared, partly filled last block is copied first
        return max(need, 0)

    def reserve(self, seq_id: SeqId, num_new: int) -> list[tuple[int, int]]:
        """Give the next ``num_new`` tokens of a sequence their slots (all or nothing).

        Returns:
            The ``(source, destination)`` block copies the storage must make first
            (copy-on-write of a shared, partly filled last block), usually none.

        Raises:
            OutOfBlocks: not enough free blocks (nothing was allocated).
        """
        s = self._seq(seq_id)
        check_int("num_new", num_new, min_value=0)
        need = self.blocks_needed(seq_id, num_new)
        if need > self.allocator.num_free:
            raise OutOfBlocks(
                f"sequence {seq_id!r} needs {need} block(s), {self.allocator.num_free} are free"
            )
        bs = self.block_size
        copies = []
        if num_new > 0 and s.reserved % bs and self.allocator.refcount(s.blocks[-1]) > 1:
            copies.append(self._copy_on_write(s))
        while len(s.blocks) * bs < s.reserved + num_new:
            s.blocks.append(self.allocator.allocate())
        s.reserved += num_new
        return copies

    def _copy_on_write(self, s: _Sequence) -> tuple[int, int]:
        old = s.blocks[-1]
        new = self.allocator.allocate()
        self.allocator.release(old)  # still held by the sequence it was forked with
        s.blocks[-1] = new
        self.copies += 1
        return old, new

    def truncate(self, seq_id: SeqId, num_tokens: int) -> None:
        """Forget a sequence's tokens from ``num_tokens`` on (rejected speculative drafts):
        their reservations end and the blocks no kept token needs go back to the pool.

        Only tokens that are not computed can go: their keys and values were never
        committed, so no prefix-cache hash includes them.

        Raises:
            ValueError: ``num_tokens`` below the computed tokens or above the known ones.
        """
        s = self._seq(seq_id)
        check_int("num_tokens", num_tokens, min_value=s.computed)
        if num_tokens > len(s.tokens):
            raise ValueError(
                f"sequence {seq_id!r} knows {len(s.tokens)} tokens, cannot keep {num_tokens}"
            )
        del s.tokens[num_tokens:]
        s.reserved = min(s.reserved, num_tokens)
        keep = -(-s.reserved // self.block_size)
        while len(s.blocks) > max(keep, s.first_live):
            self.allocator.release(s.blocks.pop())

    def fork(self, parent: SeqId, child: SeqId) -> None:
        """Start ``child`` as a copy of ``parent`` that shares all its blocks (copy-on-write).

        Raises:
            ValueError: unknown parent, existing child, or a parent with reserved but
                not yet computed slots (fork between steps).
        """
        p = self._seq(parent)
        if child in self.seqs:
            raise ValueError(f"sequence {child!r} already exists")
        if p.reserved != p.computed:
            raise ValueError(f"sequence {parent!r} is inside a step; fork it between steps")
        for blk in p.blocks[p.first_live :]:
            self.allocator.incref(blk)
        self.seqs[child] = _Sequence(
            blocks=list(p.blocks),
            tokens=list(p.tokens),
            computed=p.computed,
            reserved=p.reserved,
            hashes=list(p.hashes),
            hashable=p.hashable,
            first_live=p.first_live,
        )

    def free(self, seq_id: SeqId) -> None:
        """Drop a sequence: its blocks lose a holder (registered ones stay for prefix hits)."""
        s = self.seqs.pop(seq_id, None)
        if s is None:
            raise ValueError(f"unknown sequence {seq_id!r}")
        for blk in reversed(s.blocks[s.first_live :]):  # the prefix's become the most recent
            self.allocator.release(blk)

    def reset(self) -> None:
        """Free every sequence (prefix-cache blocks are kept)."""
        for seq_id in list(self.seqs):
            self.free(seq_id)

    def commit(self, seq_id: SeqId, num_new: int) -> None:
        """Mark ``num_new`` reserved tokens computed (their keys/values are stored):
        register the blocks they filled in the prefix cache and free the blocks behind
        the sliding window. A sequence freed meanwhile is skipped."""
        s = self.seqs.get(seq_id)
        if s is None:
            return
        if s.computed + num_new > s.reserved:
            raise ValueError(
                f"sequence {seq_id!r}: {num_new} token(s) computed, {s.reserved - s.computed} reserved"
            )
        s.computed += num_new
        self._register_full_blocks(s)
        self._free_behind_window(s)

    def _free_behind_window(self, s: _Sequence) -> None:
        """Return the leading blocks no later query of ``s`` can see to the pool.

        The next query sits at token ``s.computed`` and sees tokens from
        ``s.computed - W + 1`` on; block ``i`` ends at token ``(i + 1) * bs - 1``.
        """
        w = self.sliding_window
        if w is None:
            return
        bs = self.block_size
        while s.first_live < len(s.blocks) and (s.first_live + 1) * bs + w - 1 <= s.computed:
            self.allocator.release(s.blocks[s.first_live])
            s.blocks[s.first_live] = FREED
            s.first_live += 1

    def _register_full_blocks(self, s: _Sequence) -> None:
        if not (self.prefix_caching and s.hashable):
            return
        bs = self.block_size
        while len(s.hashes) < s.computed // bs:
            i = len(s.hashes)
            h = block_hash(s.hashes[-1] if s.hashes else None, s.tokens[i * bs : (i + 1) * bs])
            s.hashes.append(h)
            self.allocator.register(s.blocks[i], h)
