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

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from attnlab.backends.paged import BlockTable
from attnlab.cache.kv_cache import ModelCache
from attnlab.cache.paged.allocator import BlockAllocator, OutOfBlocks, block_hash
from attnlab.functional._checks import check_int, check_positive_int

__all__ = ["PagedKVPool", "StepBatch"]

SeqId = Hashable


def _token_ids(name: str, tokens: Sequence[int]) -> list[int]:
    """``tokens`` as a list of ints >= 0; a float, a bool or a negative id is refused
    (``int(1.7)`` would silently make it token 1)."""
    return [check_int(f"{name}[{i}]", t, min_value=0) for i, t in enumerate(tokens)]


@dataclass
class _Sequence:
    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # known token ids (stored or pending)
    computed: int = 0  # tokens whose keys/values are stored
    reserved: int = 0  # tokens that have slots (>= computed)
    hashes: list[bytes] = field(default_factory=list)  # hashes of the leading full blocks
    hashable: bool = True  # token ids are known (False for rows of a plain generate)
    first_live: int = 0  # leading blocks freed behind a sliding window (entries are FREED)


#: A block-table entry whose block was freed (wholly outside the sliding window).
FREED = -1


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
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
        ):
            check_positive_int(name, value)
        vd = (
            head_dim
            if value_head_dim is None
            else check_positive_int("value_head_dim", value_head_dim)
        )
        from attnlab.cache.paged.cache import PagedKVCache

        if sliding_window is not None:
            check_positive_int("sliding_window", sliding_window)
        self.sliding_window = sliding_window
        self.num_layers = num_layers
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        slots = num_blocks * block_size
        self.keys = [
            torch.zeros(slots, num_kv_heads, head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]  # [N*bs, H_kv, h_d] each
        self.values = [
            torch.zeros(slots, num_kv_heads, vd, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]
        self.allocator = BlockAllocator(num_blocks=num_blocks)
        self.seqs: dict[SeqId, _Sequence] = {}
        self.layers = [PagedKVCache(pool=self, layer=i) for i in range(num_layers)]
        self.step: StepBatch | None = None
        self._implicit = False  # the current step was started by a plain model call
        self.copies = 0  # copy-on-write block copies

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
        per_slot = sum(
            k[0].numel() * k.element_size() + v[0].numel() * v.element_size()
            for k, v in zip(self.keys, self.values)
        )
        return per_slot * self.block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (free + evictable prefix-cache blocks)."""
        return self.allocator.num_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.allocator.num_held

    def stored_slots(self) -> int:
        """Token slots of held blocks that hold a token (a shared block is counted once)."""
        fill: dict[int, int] = {}
        bs = self.block_size
        for s in self.seqs.values():
            for i, blk in enumerate(s.blocks):
                if blk == FREED:
                    continue
                n = min(bs, max(0, s.computed - i * bs))
                if n > fill.get(blk, 0):
                    fill[blk] = n
        return sum(fill.values())

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

    def reserve(self, seq_id: SeqId, num_new: int) -> None:
        """Give the next ``num_new`` tokens of a sequence their slots (all or nothing).

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
        if num_new > 0 and s.reserved % bs and self.allocator.refcount(s.blocks[-1]) > 1:
            self._copy_on_write(s)
        while len(s.blocks) * bs < s.reserved + num_new:
            s.blocks.append(self.allocator.allocate())
        s.reserved += num_new

    def _copy_on_write(self, s: _Sequence) -> None:
        old = s.blocks[-1]
        new = self.allocator.allocate()
        bs = self.block_size
        src, dst = slice(old * bs, (old + 1) * bs), slice(new * bs, (new + 1) * bs)
        for k, v in zip(self.keys, self.values):
            k[dst] = k[src]
            v[dst] = v[src]
        self.allocator.release(old)
        s.blocks[-1] = new
        self.copies += 1

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
        """Free every sequence and end any step (prefix-cache blocks are kept)."""
        for seq_id in list(self.seqs):
            self.free(seq_id)
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
            s = self.seqs.get(sid)
            if s is None:  # freed during the step (never by the engine)
                continue
            s.computed += n
            self._register_full_blocks(s)
            self._free_behind_window(s)
        self.step = None
        self._implicit = False

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
