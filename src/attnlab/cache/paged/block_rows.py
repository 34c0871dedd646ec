"""Block tables kept as tensor rows, one per sequence, updated as the blocks grow.

Shape notation: ``R`` rows held, ``nb`` blocks of the longest sequence, ``n_s`` sequences
of a step.

A serving step hands the attention each sequence's block table as a long tensor
``[n_s, nb]``. Built from the manager's Python lists every step, that costs Python work
in the number of blocks a sequence holds (a 2048-token sequence in blocks of 16 has 128),
so a step's layout grows with the context. :class:`BlockRows` keeps one tensor row per
sequence instead and writes only what changed since the last step: the blocks appended,
and the last block (which copy-on-write may replace). A step's table is then one
``index_select`` of its sequences' rows. Blocks freed behind a sliding window keep their
old id in the row: no reader looks before the row's first live block (the kernel skips
them, the gather path masks them by position), and the id still points inside the pool.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from attnlab.cache.paged.manager import FREED, KVManager, SeqId

__all__ = ["BlockRows"]


class BlockRows:
    """One long tensor row of block ids per sequence of ``manager``, kept in sync.

    Args:
        manager: the KV manager whose sequences' blocks the rows mirror.
        width: blocks per row to start with (grown on demand).
        rows: rows to start with (grown on demand).
    """

    def __init__(self, manager: KVManager, *, width: int = 16, rows: int = 8) -> None:
        self.manager = manager
        self.table = torch.zeros(rows, width, dtype=torch.long)  # [R, nb]
        self._row: dict[SeqId, int] = {}
        self._known: dict[SeqId, tuple[object, list[int]]] = {}  # sid -> (seq, blocks seen)
        self._free: list[int] = list(range(rows - 1, -1, -1))

    def release(self, seq_id: SeqId) -> None:
        """``seq_id`` left the pool: its row is free."""
        row = self._row.pop(seq_id, None)
        self._known.pop(seq_id, None)
        if row is not None:
            self._free.append(row)

    def rows(self, seq_ids: Sequence[SeqId]) -> list[int]:
        """The row of each sequence, synced with its blocks now (work in the blocks that
        changed since its last sync, not in the blocks it holds)."""
        return [self._sync(sid) for sid in seq_ids]

    def _sync(self, sid: SeqId) -> int:
        s = self.manager._seq(sid)
        blocks = s.blocks
        known = self._known.get(sid)
        row = self._row.get(sid)
        if row is None or known is None or known[0] is not s:  # new (or a reused id)
            row = self._take() if row is None else row
            self._row[sid] = row
            seen: list[int] = []
        else:
            seen = known[1]
            if len(seen) == len(blocks) and (not blocks or seen[-1] == blocks[-1]):
                return row  # the common decode step: nothing changed
        # the last seen block may have been replaced (copy-on-write) or dropped (truncate)
        k = max(min(len(seen), len(blocks)) - 1, 0)
        if len(blocks) > self.table.shape[1]:
            self._grow(cols=len(blocks))
        tail = blocks[k:]
        if tail:
            ids = [0 if b == FREED else b for b in tail]
            self.table[row, k : len(blocks)] = torch.tensor(ids, dtype=torch.long)
        del seen[k:]
        seen.extend(tail)
        self._known[sid] = (s, seen)
        return row

    def _take(self) -> int:
        if not self._free:
            stale = [sid for sid in self._row if sid not in self.manager]
            for sid in stale:  # sequences the pool freed without a release
                self.release(sid)
        if not self._free:
            n = self.table.shape[0]
            self._grow(rows=2 * n)
            self._free = list(range(2 * n - 1, n - 1, -1))
        return self._free.pop()

    def _grow(self, *, rows: int | None = None, cols: int | None = None) -> None:
        r, c = self.table.shape
        rows, cols = rows or r, max(cols or c, c)
        if cols > c:
            cols = max(cols, 2 * c)
        grown = torch.zeros(rows, cols, dtype=torch.long)
        grown[:r, :c] = self.table
        self.table = grown
