"""The attention plan: one frozen object per forward, built once, read by every layer.

Shape notation: ``B`` rows, ``H`` query heads, ``H_kv`` key/value heads, ``L`` query
positions, ``S`` keys, ``N`` tokens of a flat batch, ``n_s`` sequences in it, ``bs``
block size.

A model (or the serving runner) describes its attention once per forward: where the
queries and keys sit (slots), the mask pattern with its score modifiers, the new
tokens' padding (for mixers with a state), the backend chosen for the call, and the KV
layout (contiguous tensors, or a paged pool's block tables, or a flat batch of several
sequences in one row). Layers take ``forward(x, plan, cache)``; a cache turns the new
keys/values into a :class:`KVView` for the plan (:meth:`attnlab.cache.KVCache.view`);
:func:`attnlab.backends.dispatch.attend` runs the plan over the view. No layer asks the
registry anything: what the registry said is in the plan (vLLM's per-step attention
metadata, in attnlab's terms).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from attnlab.backends.call import AttentionCall, Backend
from attnlab.backends.registry import get
from attnlab.backends.select import choose_call
from attnlab.functional.masks import MaskPattern

__all__ = [
    "AttentionPlan",
    "BlockTable",
    "KVView",
    "SeqGroup",
    "SequenceLayout",
    "StateGroup",
    "make_plan",
]

#: Where new tokens go: one slot for every row, or a long ``[B]``/0-d tensor.
Start = int | Tensor


@dataclass(frozen=True)
class BlockTable:
    """Where each row's keys/values live in a paged pool, in a step's layout.

    Row ``b`` holds ``lengths[b]`` tokens; token ``p`` sits in pool slot
    ``table[b, p // bs] * bs + p % bs`` and at slot ``offsets[b] + p`` of the step's
    virtual layout (the slot the pattern sees). Blocks before ``first_block[b]`` were
    freed (wholly outside a sliding window) and are not read.

    Attributes:
        table: long ``[B, nb]`` block ids (entries past a row's blocks are ignored).
        block_size: tokens per block ``bs``.
        lengths: tokens stored per row (host ints).
        offsets: virtual slot of each row's token 0 (host ints; 0 for a flat batch,
            whose slots are each sequence's own token positions).
        first_block: first block each row still holds (host ints).
    """

    table: Tensor
    block_size: int
    lengths: tuple[int, ...]
    offsets: tuple[int, ...]
    first_block: tuple[int, ...]
    #: for a backend that does not read blocks: long ``[B, T]`` pool slot of each row's
    #: token ``p`` (``T`` the longest row; 0 past a row's tokens), and its slot in the
    #: step's layout (``-1`` past a row's tokens), or None
    gather: Tensor | None = None
    gather_positions: Tensor | None = None
    #: long ``[B, 3]`` (length, offset, first block) of each row, for a compiled decode
    #: bucket whose host ints (``lengths``, ``offsets``, ``first_block``) are the bucket's
    #: fixed bounds, not the rows' values; None: made from the host ints
    meta: Tensor | None = None

    def gather_index(self) -> tuple[Tensor, Tensor]:
        """``(slots [B * T], positions [B, T])``: the pool slot of each row's token ``p``
        (``T`` the longest row; 0 past a row's tokens) and ``p`` (``-1`` past them), for a
        backend that reads gathered keys. ``gather``/``gather_positions`` when given, else
        made from the table once (kept: every layer of the step shares it)."""
        if self.gather is not None and self.gather_positions is not None:
            return self.gather.reshape(-1), self.gather_positions
        memo: tuple[Tensor, Tensor] | None = self.__dict__.get("_gather_index")
        if memo is None:
            bs, table = self.block_size, self.table
            n, nb = table.shape
            t = max(self.lengths)
            j = torch.arange(t, device=table.device)[None]  # [1, T]
            valid = j < torch.tensor(self.lengths, device=table.device)[:, None]
            jc = j.clamp(max=nb * bs - 1).expand(n, t)
            slots = (table.gather(1, jc // bs) * bs + jc % bs).masked_fill(~valid, 0)
            memo = (slots.reshape(-1), torch.where(valid, j, -1))
            self.__dict__["_gather_index"] = memo  # a frozen record: its derived index
        return memo


@dataclass(frozen=True)
class SeqGroup:
    """Sequences of a flat batch that one attention call runs as rows of a batch.

    A flat step mixes decode tokens (one per sequence) and prefill chunks (many); the
    attention spreads each group's queries into ``[n_g, W_g]`` (``W_g`` its longest
    sequence's new tokens) so that no group computes much padding: the decode
    sequences run together, each chunk with the chunks of about its length.

    Attributes:
        rows: the group's sequence indices in the layout (empty in a compiled step
            whose row count is symbolic: ``n_g`` is ``len(spread) // width``).
        width: ``W_g``.
        spread: long ``[n_g * W_g]``, the flat token at each place (its first token at
            the left padding).
        keep: long ``[N_g]``, the group's flat tokens.
        places: long ``[N_g]``, their places in ``[n_g * W_g]``.
        blocks: the group's rows of the step's block tables, or None.
    """

    rows: tuple[int, ...]
    width: int
    spread: Tensor
    keep: Tensor
    places: Tensor
    blocks: BlockTable | None = None


@dataclass(frozen=True)
class StateGroup:
    """Sequences of a flat batch that a recurrent layer runs as rows of one batch: the
    same number of new tokens (no padding to skip) and all fresh or all continuing.

    Attributes:
        rows: long ``[n_g]`` sequence indices in the layout.
        tokens: long ``[n_g * length]`` their flat tokens, row after row.
        length: new tokens of each.
        fresh: their states start now (none of their tokens was computed before).
    """

    rows: Tensor
    tokens: Tensor
    length: int
    fresh: bool


@dataclass(frozen=True)
class SequenceLayout:
    """Several sequences' tokens in one flat row ``[1, N]`` (a varlen batch), no padding.

    Sequence ``i`` owns the tokens ``bounds[i]:bounds[i + 1]`` of the row; the plan's
    ``q_positions`` say where each token sits in its own sequence, and attention never
    crosses sequences: the ``document`` pattern of the flat row, which the dispatch
    materialises as rows of a batch (:class:`SeqGroup`), one group per call.

    Attributes:
        bounds: host ints, ``n_s + 1`` token boundaries (``0 .. N``).
        seq_ids: long ``[N]``, each token's sequence (its ``document`` id).
        groups: the attention calls the sequences are grouped into.
    """

    bounds: tuple[int, ...]
    seq_ids: Tensor
    groups: tuple[SeqGroup, ...]
    state_groups: tuple[StateGroup, ...] = ()

    @property
    def num_seqs(self) -> int:
        return len(self.bounds) - 1

    @property
    def lengths(self) -> tuple[int, ...]:
        """New tokens of each sequence."""
        return tuple(b - a for a, b in zip(self.bounds, self.bounds[1:]))

    @classmethod
    def from_lengths(
        cls,
        lengths: list[int],
        *,
        blocks: BlockTable | None = None,
        fresh: list[bool] | None = None,
        device: torch.device | None = None,
    ) -> SequenceLayout:
        """The layout of sequences of ``lengths`` new tokens, in this order.

        Groups: every one-token sequence (decode) together; prefill chunks, longest
        first, share a call while the padded size stays within 1.25x their tokens.

        Args:
            lengths: new tokens per sequence.
            blocks: the sequences' block tables (one row each), split per group.
            fresh: per sequence, whether its recurrent state starts now (no token of it
                computed before); default: none is.
            device: of the index tensors.

        Raises:
            ValueError: no sequences, or a length below 1.
        """
        if not lengths or min(lengths) < 1:
            raise ValueError(f"a flat batch needs sequences of at least 1 token, got {lengths}")
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        seq = [i for i, n in enumerate(lengths) for _ in range(n)]
        groups = tuple(_group(rows, bounds, blocks, device) for rows in _group_rows(list(lengths)))
        fresh = fresh if fresh is not None else [False] * len(lengths)
        by_kind: dict[tuple[int, bool], list[int]] = {}
        for i, (n, f) in enumerate(zip(lengths, fresh)):
            by_kind.setdefault((n, f), []).append(i)
        state_groups = tuple(
            StateGroup(
                rows=torch.tensor(rows, dtype=torch.long, device=device),
                tokens=torch.tensor(
                    [t for i in rows for t in range(bounds[i], bounds[i + 1])],
                    dtype=torch.long,
                    device=device,
                ),
                length=n,
                fresh=f,
            )
            for (n, f), rows in by_kind.items()
        )
        return cls(
            bounds=tuple(bounds),
            seq_ids=torch.tensor(seq, dtype=torch.long, device=device),
            groups=groups,
            state_groups=state_groups,
        )


def _group_rows(lengths: list[int]) -> list[list[int]]:
    decode = [i for i, n in enumerate(lengths) if n == 1]
    chunks = sorted((i for i, n in enumerate(lengths) if n > 1), key=lambda i: -lengths[i])
    groups = [decode] if decode else []
    current: list[int] = []
    held = 0
    for i in chunks:
        n = lengths[i]
        width = lengths[current[0]] if current else n
        if current and (len(current) + 1) * width > 1.25 * (held + n):
            groups.append(current)
            current, held = [], 0
        current.append(i)
        held += n
    if current:
        groups.append(current)
    return groups


def _group(
    rows: list[int], bounds: list[int], blocks: BlockTable | None, device: torch.device | None
) -> SeqGroup:
    width = max(bounds[i + 1] - bounds[i] for i in rows)
    spread: list[int] = []
    keep: list[int] = []
    places: list[int] = []
    for g, i in enumerate(rows):
        a, b = bounds[i], bounds[i + 1]
        spread += [a] * (width - (b - a)) + list(range(a, b))  # right-aligned
        keep += range(a, b)
        places += range(g * width + width - (b - a), (g + 1) * width)
    sub = None
    if blocks is not None and rows == list(range(len(blocks.lengths))):
        sub = blocks  # every sequence, in order (a decode step): the step's own tables
    elif blocks is not None:
        idx = torch.tensor(rows, dtype=torch.long, device=blocks.table.device)
        sub = BlockTable(
            table=blocks.table.index_select(0, idx),
            block_size=blocks.block_size,
            lengths=tuple(blocks.lengths[i] for i in rows),
            offsets=tuple(blocks.offsets[i] for i in rows),
            first_block=tuple(blocks.first_block[i] for i in rows),
        )

    def t(x: list[int]) -> Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    return SeqGroup(tuple(rows), width, t(spread), t(keep), t(places), sub)


@dataclass(frozen=True)
class KVView:
    """The keys/values a cache hands to the attention for one plan.

    Either tensors (``key [B, H_kv, S, E]``, ``value [B, H_kv, S, Ev]`` with their slots
    ``k_positions [B|1, S]``, ``-1`` empty), or a paged layer's pools (``key
    [slots, H_kv, E]``, ``value [slots, H_kv, Ev]``) with the rows' ``block_table`` for a
    backend that reads blocks (and the step's new keys/values, for a group of fresh
    chunks that attends them).
    """

    key: Tensor
    value: Tensor
    k_positions: Tensor | None = None
    block_table: BlockTable | None = None


@dataclass(frozen=True)
class AttentionPlan:
    """One forward's attention, decided once.

    Attributes:
        call: the call's description (shapes, dtype, mask kind, pattern, ``is_causal``,
            dropout, grad mode, ``return_weights``, ``block_size`` of a paged layout):
            what the backend was chosen for.
        backend: the chosen backend's record.
        pattern: the mask pattern (with score modifiers), evaluated on slots, or None.
        positions: ``[B|1, L]`` position ids of the queries for position components
            (RoPE), or None (then ``start + arange(L)``).
        q_positions: ``[B|1, L]`` slots of the queries for the pattern, or None.
        k_positions: ``[B|1, S]`` slots of the keys (the caches' ``key_slots``), or None.
        start: slot of the first new token (an int, or a tensor in a compiled step).
        token_mask: ``[B, L]`` 1/0 over the new tokens, for mixers with a state
            (padded tokens leave it unchanged), or None.
        layout: a flat varlen batch (``B = 1``), or None.
        blocks: a paged step's block tables, one row per sequence, or None.
        write_slots: long ``[N]`` pool slot of each new token of a paged step, or None.
        state_slots: each sequence's recurrent-state slot in a serving step (recurrent
            layers), or None.
        carry: what a layer hands to later layers of the same forward (RWKV-7's first
            layer's values, ``models/linear_mixers.py``); empty at the start of a forward.
        group_backends: a paged flat step's backend per group of its layout (a decode
            group and prefill chunks cost differently: ``auto`` ranks each group's own
            call), or empty (``backend`` runs every group).
    """

    call: AttentionCall
    backend: Backend
    pattern: MaskPattern | None = None
    positions: Tensor | None = None
    q_positions: Tensor | None = None
    k_positions: Tensor | None = None
    start: Start = 0
    token_mask: Tensor | None = None
    layout: SequenceLayout | None = None
    blocks: BlockTable | None = field(default=None, repr=False)
    write_slots: Tensor | None = field(default=None, repr=False)
    state_slots: Tensor | None = field(default=None, repr=False)
    carry: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    group_backends: tuple[Backend, ...] = field(default=(), repr=False)

    @property
    def need_weights(self) -> bool:
        """The attention layers return their weights."""
        return self.call.return_weights

    @property
    def reads_blocks(self) -> bool:
        """The backend (of some group, in a flat step) reads a paged cache's pools through
        block tables: the cache hands over the pools, not gathered keys."""
        if self.call.block_size <= 0:
            return False
        return any(b.reads_blocks for b in (self.group_backends or (self.backend,)))

    def group_backend(self, index: int) -> Backend:
        """The backend of group ``index`` of the plan's layout."""
        return self.group_backends[index] if self.group_backends else self.backend

    def with_weights(self) -> AttentionPlan:
        """This plan returning the attention weights (for tools that read them): its
        backend if that one returns weights, else ``auto``'s choice for such a call."""
        call = replace(self.call, return_weights=True)
        try:
            backend = resolve(call, self.backend.name)
        except ValueError:  # the plan's backend returns no weights
            backend = resolve(call)
        return replace(self, call=call, backend=backend)

    def for_call(self, call: AttentionCall, backend: str = "auto") -> AttentionPlan:
        """This plan for another call of the same forward (its backend chosen for it)."""
        return replace(self, call=call, backend=resolve(call, backend))


def resolve(call: AttentionCall, backend: str = "auto", *, chosen: str | None = None) -> Backend:
    """The backend record that runs ``call``: ``auto``'s (memoized) choice, or the named
    one's (checked), or ``chosen``, a name the caller resolved before (not consulted
    again: a compiled step cannot read the registry's context)."""
    if chosen is not None:
        return get(chosen)
    return get(choose_call(call, backend).chosen)


def _group_call(call: AttentionCall, group: SeqGroup) -> AttentionCall:
    """The call of one group of a flat paged step: its rows, width and longest row."""
    assert group.blocks is not None
    n, t = len(group.rows), max(group.blocks.lengths)
    q, k, v = call.query_shape, call.key_shape, call.value_shape
    return replace(
        call,
        query_shape=(n, q[1], group.width, q[-1]),
        key_shape=(n, k[1], t, k[-1]),
        value_shape=(n, v[1], t, v[-1]),
    )


def make_plan(
    call: AttentionCall,
    *,
    backend: str = "auto",
    chosen: str | None = None,
    pattern: MaskPattern | None = None,
    positions: Tensor | None = None,
    q_positions: Tensor | None = None,
    k_positions: Tensor | None = None,
    start: Start = 0,
    token_mask: Tensor | None = None,
    layout: SequenceLayout | None = None,
    blocks: BlockTable | None = None,
    write_slots: Tensor | None = None,
    state_slots: Tensor | None = None,
) -> AttentionPlan:
    """The plan of ``call``, with its backend chosen now (memoized per call kind).

    Args:
        call: the call every attention layer of the forward shares.
        backend: ``"auto"`` (the registry's choice, :func:`~attnlab.backends.use`
            respected), or a backend name (checked against the call).
        chosen: a backend name resolved beforehand (e.g. for a compiled step), used as is.
            Without it, a paged flat step (``layout`` with ``blocks``) has each group's
            backend chosen for the group's own call (``group_backends``).
        pattern, positions, q_positions, k_positions, start, token_mask, layout,
            blocks, write_slots, state_slots: the :class:`AttentionPlan` fields.

    Raises:
        ValueError: a named backend that cannot run the call, or an unknown name.
    """
    chosen_backend = resolve(call, backend, chosen=chosen)
    groups: tuple[Backend, ...] = ()
    if layout is not None and blocks is not None and call.block_size > 0 and chosen is None:
        groups = tuple(resolve(_group_call(call, g), backend) for g in layout.groups)
        if all(b is chosen_backend for b in groups):
            groups = ()
    return AttentionPlan(
        call=call,
        backend=chosen_backend,
        group_backends=groups,
        pattern=pattern,
        positions=positions,
        q_positions=q_positions,
        k_positions=k_positions,
        start=start,
        token_mask=token_mask,
        layout=layout,
        blocks=blocks,
        write_slots=write_slots,
        state_slots=state_slots,
    )
