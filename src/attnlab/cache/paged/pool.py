"""The paged KV pool: one preallocated block pool per layer, block tables, steps.

Shape notation: ``N`` blocks, ``bs`` block size, ``H_kv`` key/value heads, ``h_d``
head dim, ``B`` rows of a step, ``L`` new tokens per row (the longest row's count),
``T`` slots of the step's virtual layout.

A :class:`PagedKVPool` holds, for every layer, a key and a value tensor of
``N * bs`` token slots (``[N * bs, H_kv, h_d]``), the :class:`BlockAllocator`
shared by all layers (a block id names the same slots in every layer), and one
*block table* per sequence: the list of its blocks, in order, so token ``p`` of the
sequence lives in slot ``table[p // bs] * bs + p % bs`` (Kwon et al., 2023).

A *step* runs some sequences through the model at once, each with its own number of
new tokens (a chunk of its prompt, or the one token it just sampled). The pool lays
the step out as a left-padded batch: row ``b`` holds its ``C_b`` cached tokens and
``L_b`` new ones right-aligned in ``T = max_b (C_b + L_b)`` virtual slots, and the
new tokens are the last ``L_b`` of the ``L = max_b L_b`` input positions. This is
the layout every decoder already runs (a padded batch with an ``attention_mask``),
so the paged cache plugs into the one model forward unchanged: positions come from
the mask, the causal and sliding-window masks compare slots, and a row's padding is
never attended to. Each layer's :class:`~attnlab.cache.paged.cache.PagedKVCache`
writes the new keys/values into the pool and returns the row's keys/values gathered
through its block table (``[B, H_kv, T, h_d]``): the gather is the reference path.

Copy-on-write: a block held by several sequences (a fork) is never written; a
sequence that must write into a shared, partially filled block first copies it to a
block of its own in every layer. Full blocks are never written again, so they are
shared freely, and they are registered in the prefix cache under their chained
content hash.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from attnlab.backends.plan import BlockTable
from attnlab.cache.kv_cache import ModelCache
from attnlab.cache.paged.allocator import OutOfBlocks
from attnlab.cache.paged.manager import KVManager, SeqId, _Sequence
from attnlab.cache.paged.storage import KVStorage
from attnlab.functional._checks import check_int

__all__ = ["PagedKVPool", "StepBatch"]


@dataclass
class StepBatch:
    """The inputs of one step in the pool's left-padded layout.

    Attributes:
        seq_ids: the sequence of each row.
        num_new: new tokens of each row (``L_b``).
        input_ids: ``[B, L]`` long, each row's new tokens right-aligned (0 before them).
        attention_mask: ``[B, T]`` long 1/0 (1 on a row's tokens), or None when every
            row has the same length.
        start: slot of the first input position (``T - L``).
    """

    seq_ids: list[SeqId]
    num_new: list[int]
    input_ids: Tensor
    attention_mask: Tensor | None
    start: int
    # internal: flat row*L + j indices of the new tokens, their pool slots, the gather index
    src: Tensor = field(repr=False, default_factory=lambda: torch.empty(0))
    dst: Tensor = field(repr=False, default_factory=lambda: torch.empty(0))
    gather: Tensor = field(repr=False, default_factory=lambda: torch.empty(0))
    all_new: bool = False  # every input position is a new token (no selection needed)
    blocks: BlockTable | None = field(repr=False, default=None)  # for the paged backend

    @property
    def total(self) -> int:
        """``T``: virtual slots of the step."""
        return self.start + self.input_ids.shape[1]


class PagedKVPool:
    """Keys/values of many sequences in fixed-size blocks of one preallocated pool per layer.

    Args:
        num_layers: layers (one key and one value pool each).
        num_kv_heads: key/value heads ``H_kv``.
        head_dim: head dim ``h_d`` of keys (and values, unless ``value_head_dim``).
        num_blocks: blocks ``N`` in each layer's pool.
        block_size: tokens per block ``bs`` (vLLM's default is 16).
        dtype, device: of the pools.
        value_head_dim: head dim of values when it differs from keys'.
        prefix_caching: register full blocks by content hash and reuse them.
        sliding_window: the model's window ``W`` (a query at ``p`` sees keys
            ``p - W + 1 .. p``, Mistral's convention), or None: after each step, a
            sequence's blocks wholly before its next query's window are returned to the
            pool, so a sequence holds at most ``ceil(W / bs) + 1`` blocks.
        kv_dtype: None (pools in ``dtype``), ``"int8"``/``"int4"`` (keys and values
            stored quantized per token) or ``"int8-channel"``/``"int4-channel"`` (keys per
            channel over each block, KIVI's layout; values per token), dequantized in the
            gather (:class:`~attnlab.cache.paged.storage.KVStorage`).
        spare_blocks: blocks the storage holds past the ``N`` the manager hands out:
            block ``N`` is the scratch a compiled decode bucket's padding rows write to
            (:mod:`attnlab.serving.decode_buckets`), never a sequence's.

    Raises:
        ValueError: a size that is not a positive int.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        value_head_dim: int | None = None,
        prefix_caching: bool = True,
        sliding_window: int | None = None,
        kv_dtype: str | None = None,
        spare_blocks: int = 0,
    ) -> None:
        from attnlab.cache.paged.cache import PagedKVCache

        self.manager = KVManager(
            num_blocks=num_blocks,
            block_size=block_size,
            prefix_caching=prefix_caching,
            sliding_window=sliding_window,
        )
        self.storage = KVStorage(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            num_blocks=num_blocks + spare_blocks,
            block_size=block_size,
            dtype=dtype,
            device=device,
            value_head_dim=value_head_dim,
            kv_dtype=kv_dtype,
        )
        self.num_layers = num_layers
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.layers = [PagedKVCache(pool=self, layer=i) for i in range(num_layers)]
        self.step: StepBatch | None = None
        self._implicit = False  # the current step was started by a plain model call

    # the manager's and the storage's state, under the pool's names
    keys = property(lambda self: self.storage.keys)
    values = property(lambda self: self.storage.values)
    seqs = property(lambda self: self.manager.seqs)
    allocator = property(lambda self: self.manager.allocator)
    prefix_caching = property(lambda self: self.manager.prefix_caching)
    sliding_window = property(lambda self: self.manager.sliding_window)
    copies = property(lambda self: self.manager.copies)

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, *, num_blocks: int, block_size: int = 16, **kwargs: object
    ) -> PagedKVPool:
        """A pool shaped for an attnlab decoder (layers, key/value heads, head dim, dtype,
        device, and its sliding window)."""
        config = getattr(model, "config", None)
        needed = ("num_hidden_layers", "num_key_value_heads", "head_dim")
        if config is None or not all(getattr(config, n, None) for n in needed):
            raise TypeError(
                f"a paged pool needs a decoder with a DecoderConfig, got {type(model).__name__}"
            )
        p = next(model.parameters())
        opts: dict = {
            "dtype": p.dtype,
            "device": p.device,
            "sliding_window": getattr(config, "sliding_window", None),
        } | dict(kwargs)
        return cls(
            num_layers=config.num_hidden_layers,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            **opts,
        )

    def model_cache(self) -> ModelCache:
        """The model-level cache (``past_key_values``) whose layers read and write this pool."""
        return ModelCache(layers=list(self.layers))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ sizes

    def bytes_per_block(self) -> int:
        """Bytes of one block over all layers (keys and values)."""
        return self.storage.bytes_per_block()

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (free + evictable prefix-cache blocks)."""
        return self.manager.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.manager.num_used_blocks

    def stored_slots(self) -> int:
        """Token slots of held blocks that hold a token (a shared block is counted once)."""
        return self.manager.stored_slots()

    def waste(self) -> float:
        """Allocated slots holding no token / allocated slots (0 when nothing is allocated)."""
        return self.manager.waste()

    # ------------------------------------------------------------------ sequences
    # (the manager's book-keeping; see :class:`~attnlab.cache.paged.manager.KVManager`)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self.manager

    def _seq(self, seq_id: SeqId) -> _Sequence:
        return self.manager._seq(seq_id)

    def add_sequence(self, seq_id: SeqId, tokens: Sequence[int]) -> int:
        """See :meth:`KVManager.add_sequence`."""
        return self.manager.add_sequence(seq_id, tokens)

    def append_tokens(self, seq_id: SeqId, tokens: Sequence[int]) -> None:
        """See :meth:`KVManager.append_tokens`."""
        self.manager.append_tokens(seq_id, tokens)

    def num_tokens(self, seq_id: SeqId) -> int:
        return self.manager.num_tokens(seq_id)

    def num_computed(self, seq_id: SeqId) -> int:
        return self.manager.num_computed(seq_id)

    def block_table(self, seq_id: SeqId) -> list[int]:
        return self.manager.block_table(seq_id)

    def blocks_needed(self, seq_id: SeqId, num_new: int) -> int:
        return self.manager.blocks_needed(seq_id, num_new)

    def reserve(self, seq_id: SeqId, num_new: int) -> None:
        """Give the next ``num_new`` tokens their slots, copying a shared block first.

        Raises:
            OutOfBlocks: not enough free blocks (nothing was allocated).
        """
        self.storage.copy_blocks(self.manager.reserve(seq_id, num_new))

    def fork(self, parent: SeqId, child: SeqId) -> None:
        """See :meth:`KVManager.fork`."""
        self.manager.fork(parent, child)

    def free(self, seq_id: SeqId) -> None:
        """See :meth:`KVManager.free`."""
        s = self.manager.seqs.get(seq_id)
        blocks = [] if s is None else list(s.blocks[s.first_live :])  # the ones it holds
        self.manager.free(seq_id)
        # per-channel quantized keys: a block freed while filling drops its float copy
        self.storage.drop_partial(b for b in blocks if self.allocator.refcount(b) == 0)

    def reset(self) -> None:
        """Free every sequence and end any step (prefix-cache blocks are kept)."""
        self.manager.reset()
        self.storage.drop_partial(range(self.num_blocks))
        self.step = None
        self._implicit = False
        for c in self.layers:
            c.length = 0

    # ------------------------------------------------------------------ steps

    def begin_step(self, rows: Sequence[tuple[SeqId, int]]) -> StepBatch:
        """Lay out one step: each ``(seq_id, num_new)`` row runs its next ``num_new`` tokens.

        The rows must have been :meth:`reserve`-d. Sets every layer cache's ``length``
        to the step's start slot, so ``model(batch.input_ids, attention_mask=...,
        past_key_values=pool.model_cache())`` runs the step; call :meth:`end_step` after.

        Raises:
            ValueError: no rows, a row without reserved slots or known tokens.
        """
        if not rows:
            raise ValueError("a step needs at least one row")
        row_ids = [sid for sid, _ in rows]
        if len(set(row_ids)) != len(row_ids):
            twice = sorted({repr(i) for i in row_ids if row_ids.count(i) > 1})
            raise ValueError(f"a step runs each sequence once; {', '.join(twice)} appear twice")
        self._finish_implicit()
        seqs = [self._seq(sid) for sid, _ in rows]
        num_new = [check_int("num_new", n, min_value=1) for _, n in rows]
        for (sid, n), s in zip(rows, seqs):
            if n <= 0 or s.computed + n > s.reserved:
                raise ValueError(
                    f"sequence {sid!r}: {n} new token(s) but {s.reserved - s.computed} reserved"
                )
            if s.hashable and s.computed + n > len(s.tokens):
                raise ValueError(
                    f"sequence {sid!r}: {n} new token(s) but only {len(s.tokens) - s.computed} known"
                )
        totals = [s.computed + n for s, n in zip(seqs, num_new)]
        ids = [
            s.tokens[s.computed : s.computed + n] if s.hashable else []
            for s, n in zip(seqs, num_new)
        ]
        step = self._layout(seqs, num_new, totals, ids)
        step.seq_ids = [sid for sid, _ in rows]
        self.step = step
        for c in self.layers:
            c.length = step.start
        return step

    def _layout(
        self, seqs: list[_Sequence], num_new: list[int], totals: list[int], ids: list[list[int]]
    ) -> StepBatch:
        bs = self.block_size
        b, width, t = len(seqs), max(num_new), max(totals)
        dev = self.keys[0].device
        rows_ids: list[list[int]] = []
        src: list[int] = []
        dst: list[int] = []
        nb = max(len(s.blocks) for s in seqs)
        tables: list[list[int]] = []
        for r, (s, n) in enumerate(zip(seqs, num_new)):
            rows_ids.append([0] * (width - len(ids[r])) + ids[r])
            src.extend(range(r * width + width - n, (r + 1) * width))
            blocks = s.blocks
            dst.extend(blocks[p // bs] * bs + p % bs for p in range(s.computed, s.computed + n))
            # a freed block reads block 0: its slots lie outside every query's window
            live = [0] * s.first_live + blocks[s.first_live :]
            tables.append(live + [0] * (nb - len(blocks)))
        table = torch.tensor(tables, dtype=torch.long)  # [B, blocks]
        tot = torch.tensor(totals, dtype=torch.long)
        logical = torch.arange(t)[None, :] - (t - tot)[:, None]  # [B, T] token index per slot
        valid = logical >= 0
        lc = logical.clamp(min=0)
        phys = (table.gather(1, lc // bs) * bs + lc % bs).masked_fill(~valid, 0)  # [B, T]
        uniform = min(totals) == t
        mask = None if uniform else valid.long()
        input_ids = torch.tensor(rows_ids, dtype=torch.long)
        block_table = BlockTable(
            table=table.to(dev),
            block_size=bs,
            lengths=tuple(totals),
            offsets=tuple(t - n for n in totals),
            first_block=tuple(s.first_live for s in seqs),
        )
        return StepBatch(
            seq_ids=[],
            num_new=num_new,
            input_ids=input_ids.to(dev),
            attention_mask=None if mask is None else mask.to(dev),
            start=t - width,
            src=torch.tensor(src, dtype=torch.long, device=dev),
            dst=torch.tensor(dst, dtype=torch.long, device=dev),
            gather=phys.reshape(-1).to(dev),
            all_new=len(src) == b * width,
            blocks=block_table,
        )

    def end_step(self) -> None:
        """Mark the step's tokens computed and register the blocks it filled in the prefix cache."""
        step = self.step
        if step is None:
            raise ValueError("no step is running")
        for sid, n in zip(step.seq_ids, step.num_new):
            self.manager.commit(sid, n)  # (a sequence freed during the step is skipped)
        self.step = None
        self._implicit = False

    # ------------------------------------------------------------------ plain model calls

    def _finish_implicit(self) -> None:
        if self._implicit:
            self.end_step()

    def implicit_step(self, batch: int, start: int, num_new: int) -> StepBatch:
        """The step of a plain model call (e.g. ``generate`` with ``past_key_values`` from
        :meth:`model_cache`): rows ``0..B-1`` are sequences ``("row", b)`` of equal length.

        Called by the first layer's cache; the step ends when the next one begins.

        Raises:
            ValueError: ``start`` is not the rows' length.
            OutOfBlocks: the pool is full.
        """
        self._finish_implicit()
        rows = [("row", r) for r in range(batch)]
        if start == 0:
            for sid in rows:
                if sid in self.seqs:
                    self.free(sid)
        for sid in rows:
            if sid not in self.seqs:
                if start != 0:
                    raise ValueError(f"row {sid[1]} of the cache is empty, but start={start}")
                self.seqs[sid] = _Sequence(hashable=False)
            s = self.seqs[sid]
            if s.computed != start:
                raise ValueError(
                    f"the paged cache holds {s.computed} token(s) in row {sid[1]}, got start={start}"
                )
        total = sum(self.blocks_needed(sid, num_new) for sid in rows)
        if total > self.allocator.num_free:
            raise OutOfBlocks(
                f"the step needs {total} block(s), {self.allocator.num_free} are free "
                f"(num_blocks={self.num_blocks})"
            )
        for sid in rows:
            self.reserve(sid, num_new)
        step = self.begin_step([(sid, num_new) for sid in rows])
        self._implicit = True
        return step

    def select_rows(self, rows: Tensor) -> None:
        """Keep/reorder the rows of a plain model call (``ModelCache.select``); a row taken
        twice is forked (copy-on-write), a row not taken is freed."""
        self._finish_implicit()
        order = [int(r) for r in rows.tolist()]
        old = {r: ("row", r) for r in range(len([k for k in self.seqs if _is_row(k)]))}
        for r in order:
            if r not in old:
                raise ValueError(f"row {r} out of range for {len(old)} cached rows")
        tmp = {r: ("tmp", r) for r in old}
        for r, sid in old.items():
            self.seqs[tmp[r]] = self.seqs.pop(sid)
        for i, r in enumerate(order):
            self.fork(tmp[r], ("row", i))
        for t in tmp.values():
            self.free(t)


def _is_row(seq_id: object) -> bool:
    return isinstance(seq_id, tuple) and len(seq_id) == 2 and seq_id[0] == "row"


__all__ += ["OutOfBlocks"]
