"""The scheduler: which tokens of which requests run in the next step (torch-free).

Iteration-level scheduling (Yu et al., 2022, "Orca"): each :meth:`Scheduler.schedule`
builds one step under a token budget: first one token for every decoding sequence,
then chunks of prompts still being prefilled (chunked prefill, Agrawal et al., 2023,
"Sarathi"), then new requests in arrival order while blocks and budget last. Blocks are
reserved in the :class:`~attnlab.cache.paged.manager.KVManager`; when it runs out, the
latest-arrived running sequence is preempted: its blocks are freed and it is recomputed
later from its tokens, so no sequence is ever corrupted and a step never fails for
memory. The result says which ``(sequence, new tokens)`` rows run and which blocks the
storage must copy first (copy-on-write), as vLLM's ``SchedulerOutput`` does.

Speculative decoding (an optional ``drafter``): the budget left after every decode
token, prefill chunk and new request goes to drafted tokens of the decoding sequences,
in arrival order. A decoding row then carries its last token and its drafts (the model
verifies them in the same forward); drafts never preempt: a sequence whose drafts do not
fit in the free blocks runs its one token alone. A drafter that answers a count instead
of tokens (a draft model, which drafts after scheduling) gets that many slots reserved;
the engine fills in the tokens before the forward.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from attnlab.cache.paged.manager import KVManager, OutOfBlocks

__all__ = ["ScheduledStep", "Scheduler"]

log = logging.getLogger(__name__)


@dataclass
class ScheduledStep:
    """One step's work.

    Attributes:
        rows: ``(sequence, new tokens)`` in the order the runner lays them out.
        copies: ``(source, destination)`` block copies to make before the forward.
        drafts: ``seq_id -> drafted tokens`` of the rows that verify drafts (the row's
            new tokens are its last token and these, known to the manager until the
            engine cuts the rejected ones off).
        draft_slots: ``seq_id -> k`` of the rows whose ``k`` drafts are still to be made
            (a draft model): the row counts them and their slots are reserved, but the
            manager does not know their tokens yet.
    """

    rows: list[tuple[Any, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    drafts: dict[Any, list[int]] = field(default_factory=dict)
    draft_slots: dict[Any, int] = field(default_factory=dict)


class Scheduler:
    """Waiting and running sequences, and the choice of each step's tokens.

    A sequence is any object with ``seq_id``, ``tokens`` (its known token ids),
    ``index`` (its choice index), ``request.order`` (arrival) and ``in_pool``.

    Args:
        manager: the KV manager whose blocks the sequences hold.
        max_num_seqs: the most sequences running at once.
        max_num_batched_tokens: the token budget of a step.
        on_admit: called with ``(sequence, cached tokens)`` when a sequence enters.
        on_preempt: called with a sequence that lost its blocks (before it waits again).
        drafter: ``drafter(sequence, at_most) -> tokens`` drafts for a decoding sequence
            (speculative decoding), or ``-> k``: reserve ``k`` slots for drafts made
            after scheduling (a draft model); or None.
    """

    def __init__(
        self,
        manager: KVManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        on_admit: Callable[[Any, int], None] | None = None,
        on_preempt: Callable[[Any], None] | None = None,
        drafter: Callable[[Any, int], list[int] | int] | None = None,
    ) -> None:
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max(max_num_batched_tokens, max_num_seqs)
        self.waiting: deque[Any] = deque()
        self.running: list[Any] = []
        self.preemptions = 0
        self._on_admit = on_admit
        self._on_preempt = on_preempt
        self._drafter = drafter

    def _preempt(self, step: ScheduledStep) -> Any:
        """Free the lowest-priority (latest-arrived) running sequence; recompute it later."""
        victim = max(self.running, key=lambda s: (s.request.order, s.index))
        self.running.remove(victim)
        self.manager.free(victim.seq_id)
        victim.in_pool = False
        if self._on_preempt is not None:
            self._on_preempt(victim)
        self.waiting.appendleft(victim)
        step.rows[:] = [r for r in step.rows if r[0] is not victim]
        self.preemptions += 1
        log.debug("preempted sequence %s", victim.seq_id)
        return victim

    def schedule(self) -> ScheduledStep:
        """The next step: decode tokens, then prefill chunks, then new sequences."""
        step = ScheduledStep()
        budget = self._running_rows(step, self.max_num_batched_tokens)
        budget = self._admit(step, budget)
        if self._drafter is not None and budget > 0:
            self._draft(step, budget, self._drafter)
        return step

    def _draft(
        self, step: ScheduledStep, budget: int, drafter: Callable[[Any, int], list[int] | int]
    ) -> None:
        """Give the decoding rows drafted tokens from the budget left (never preempting)."""
        m = self.manager
        for r, (seq, n) in enumerate(step.rows):
            if budget <= 0:
                break
            if n != 1 or m.num_tokens(seq.seq_id) - m.num_computed(seq.seq_id) != 1:
                continue  # a prefill chunk, or a sequence that is not decoding
            drafts = drafter(seq, budget)
            if isinstance(drafts, int):  # slots for a draft model's tokens
                k = min(drafts, budget)
                if k <= 0:
                    continue
                try:
                    step.copies += m.reserve(seq.seq_id, k)
                except OutOfBlocks:
                    continue
                step.rows[r] = (seq, 1 + k)
                step.draft_slots[seq.seq_id] = k
                budget -= k
                continue
            drafts = drafts[:budget]
            if not drafts:
                continue
            known = m.num_tokens(seq.seq_id)
            m.append_tokens(seq.seq_id, drafts)
            try:
                step.copies += m.reserve(seq.seq_id, len(drafts))
            except OutOfBlocks:
                m.truncate(seq.seq_id, known)
                continue
            step.rows[r] = (seq, 1 + len(drafts))
            step.drafts[seq.seq_id] = drafts
            budget -= len(drafts)

    def _running_rows(self, step: ScheduledStep, budget: int) -> int:
        m = self.manager
        pending = {
            s.seq_id: m.num_tokens(s.seq_id) - m.num_computed(s.seq_id) for s in self.running
        }
        # decode tokens first, then prefill chunks, each in arrival order
        order = sorted(
            self.running, key=lambda s: (pending[s.seq_id] > 1, s.request.order, s.index)
        )
        for seq in order:
            if seq not in self.running or budget <= 0:
                continue
            n = min(pending[seq.seq_id], budget)
            while True:
                try:
                    step.copies += m.reserve(seq.seq_id, n)
                    step.rows.append((seq, n))
                    budget -= n
                    break
                except OutOfBlocks:
                    if self._preempt(step) is seq:
                        break
        return budget

    def _admit(self, step: ScheduledStep, budget: int) -> int:
        m = self.manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = m.add_sequence(seq.seq_id, seq.tokens)
            n = min(len(seq.tokens) - cached, budget)
            spare = len(self.running)  # a block of room for each running sequence to grow
            if m.blocks_needed(seq.seq_id, n) + spare > m.num_free_blocks and self.running:
                m.free(seq.seq_id)
                break
            try:
                step.copies += m.reserve(seq.seq_id, n)
            except OutOfBlocks:
                m.free(seq.seq_id)
                break
            self.waiting.popleft()
            seq.in_pool = True
            if self._on_admit is not None:
                self._on_admit(seq, cached)
            self.running.append(seq)
            step.rows.append((seq, n))
            budget -= n
        return budget
