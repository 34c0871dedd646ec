"""Recurrent states of many sequences: one slot per sequence, per layer (serving).

Where attention layers keep keys/values in blocks, a recurrent layer (Mamba, Mamba-2,
RWKV, RetNet, the linear mixers) keeps one fixed-size state per sequence, whatever its
length: the layer's cache spec is "one state slot per sequence" (vLLM's ``MambaSpec``).
:class:`StateSlots` holds one layer's states of every slot as ``[num_slots, ...]``
tensors (made on the first write, in the state's own shapes and dtype);
:meth:`StateSlots.gather` hands a step's sequences their states as one
:class:`~attnlab.cache.recurrent.RecurrentState` of ``n`` rows, which the layer's mixer
reads and updates as it would any state, and :meth:`StateSlots.scatter` writes it back.

A state has no blocks, so a prefix of it cannot be shared: a fork copies the slot, and a
sequence that lost its slot (preempted) is recomputed from its tokens.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from attnlab.cache.base import LayerCache, check_rows
from attnlab.cache.recurrent import RecurrentState

__all__ = ["SlotTable", "StateSlots"]


class StateSlots(LayerCache):
    """One recurrent layer's state slots.

    Args:
        make: a fresh (empty) state of the layer's kind, e.g. ``MambaState``.
        num_slots: the most sequences served at once.
    """

    def __init__(self, *, make: Callable[[], RecurrentState], num_slots: int) -> None:
        super().__init__()
        self.make = make
        self.num_slots = num_slots
        self.store: dict[str, Tensor] | None = None

    def gather(self, slots: Tensor, fresh: bool) -> RecurrentState:
        """The states of ``slots`` (long ``[n]``) as one state of ``n`` rows; an empty one
        for sequences whose state starts now (``fresh``)."""
        state = self.make()
        if fresh or self.store is None:
            return state
        for name, t in self.store.items():
            setattr(state, name, t.index_select(0, slots))
        state.batch_size = int(slots.numel())
        return state

    def scatter(self, slots: Tensor, state: RecurrentState) -> None:
        """Write ``state``'s rows back to ``slots``."""
        if self.store is None:
            self.store = {}
        for name in state._fields:
            t = getattr(state, name)
            if t is None:
                continue
            if name not in self.store:
                self.store[name] = t.new_zeros((self.num_slots, *t.shape[1:]))
            self.store[name].index_copy_(0, slots, t.detach())

    def copy(self, src: int, dst: int) -> None:
        """Copy slot ``src``'s state to slot ``dst`` (a fork)."""
        for t in (self.store or {}).values():
            t[dst] = t[src]

    def select(self, rows: Tensor) -> None:
        check_rows(rows, self.num_slots)
        raise ValueError(
            "state slots are addressed by slot (a serving cache); select rows of a plain state"
        )

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.store or {}).values())

    def reset(self) -> None:
        super().reset()
        self.store = None


class SlotTable:
    """Which state slot each sequence holds (host side, torch-free).

    Args:
        num_slots: slots available.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.slots: dict[object, int] = {}

    def slot(self, seq_id: object) -> int:
        """The slot of ``seq_id``, taking a free one on first use.

        Raises:
            ValueError: every slot is taken.
        """
        if seq_id not in self.slots:
            if not self.free_slots:
                raise ValueError(f"all {self.num_slots} state slots are taken")
            self.slots[seq_id] = self.free_slots.pop()
        return self.slots[seq_id]

    def release(self, seq_id: object) -> None:
        """Give ``seq_id``'s slot back (nothing if it holds none)."""
        slot = self.slots.pop(seq_id, None)
        if slot is not None:
            self.free_slots.append(slot)
