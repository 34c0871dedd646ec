"""The engine's requests: admission, the ``n`` choices, aborts, failures, offline runs.

:class:`RequestLifecycle` is the part of :class:`~attnlab.serving.engine.Engine` that
keeps each request's lifecycle between steps: the admission checks
(:func:`~attnlab.serving.validation.validate_request`), the waiting queue's bound, the
sequences of a request (its ``n`` choices are forked from the prompt's blocks at its
first token), aborts, and the failure of one request without the others (its blocks
are freed, its error kept for its client). The step itself (schedule, forward, sample,
verify) is :class:`~attnlab.serving.engine.Engine`'s.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from attnlab.cache.paged.pool import PagedKVPool
from attnlab.serving.detokenize import IncrementalDetokenizer
from attnlab.serving.draft_model import DraftRunner
from attnlab.serving.metrics import EngineMetrics
from attnlab.serving.output_processor import OutputProcessor
from attnlab.serving.outputs import CompletionDelta, Request, Seq, run_offline
from attnlab.serving.params import SamplingParams
from attnlab.serving.runner import ModelRunner
from attnlab.serving.scheduler import Scheduler
from attnlab.serving.validation import validate_request

__all__ = ["QueueFull", "RequestLifecycle"]

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The waiting queue is full (the server answers 429)."""


class RequestLifecycle:
    """Requests and their sequences, between steps (the base of the engine).

    The engine's constructor sets the attributes below.
    """

    tokenizer: Any
    vocab_size: int
    max_model_len: int
    max_waiting: int
    pool: PagedKVPool
    runner: ModelRunner
    draft: DraftRunner | None
    scheduler: Scheduler
    requests: dict[str, Request]
    metrics: EngineMetrics
    output: OutputProcessor
    _seq_ids: itertools.count[int]
    _order: itertools.count[int]

    @property
    def eos_ids(self) -> set[int]:
        """The end-of-sequence tokens (the tokenizer's, else the config's)."""
        return self.output.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: set[int]) -> None:
        self.output.eos_ids = set(ids)

    # ------------------------------------------------------------------ requests

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Check a request against the context; raise :class:`ParamError` naming the field."""
        validate_request(
            prompt_ids,
            params,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            block_size=self.pool.block_size,
            num_blocks=self.pool.num_blocks,
        )

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
    ) -> None:
        """Queue a request (text, or token ids).

        Raises:
            ParamError: the request does not fit the context (``param`` names the field).
            QueueFull: ``max_waiting`` requests are queued already.
            ValueError: ``request_id`` is in use.
        """
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate(ids, params)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is in use")
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(
                f"{len(self.waiting)} requests are waiting (max_waiting={self.max_waiting})"
            )
        req = Request(request_id, ids, params, time.perf_counter(), next(self._order))
        self.requests[request_id] = req
        seq = self._new_seq(req, 0)
        self.waiting.append(seq)
        self.metrics.requests_received += 1

    def _new_seq(self, req: Request, index: int) -> Seq:
        gen = None
        p = req.params
        if not p.greedy and p.seed is not None:  # seed <= 2**63 - 1: seed + index fits torch
            gen = torch.Generator().manual_seed(p.seed + index)
        seq = Seq(
            next(self._seq_ids),
            req,
            index,
            gen,
            IncrementalDetokenizer(
                self.tokenizer, req.prompt_ids, skip_special_tokens=p.skip_special_tokens
            ),
        )
        if p.grammar is not None:
            seq.matcher = p.grammar.matcher()
        req.seqs.append(seq)
        return seq

    def gauges(self) -> dict[str, float]:
        """The gauges of ``/metrics`` as they are now (not as of the last step)."""
        used = self.pool.num_used_blocks
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "blocks_used": used,
            "waste": self.metrics.waste if used else 0.0,
        }

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks. Returns False for an unknown/finished id."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
            self._drop(seq)
        self.metrics.requests_aborted += 1
        return True

    def _fail(self, req: Request, error: str) -> None:
        """Fail one request inside a step: free its blocks, keep the error for its client."""
        if req.error is not None:
            return
        log.warning("request %s failed: %s", req.request_id, error)
        req.error = error
        for seq in req.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = "error"
            self._drop(seq)

    def _drop(self, seq: Seq) -> None:
        if seq.in_pool:
            self.pool.free(seq.seq_id)
            self.runner.release(seq.seq_id)
            if self.draft is not None:
                self.draft.release(seq.seq_id)
            seq.in_pool = False
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)

    @property
    def waiting(self) -> deque[Seq]:
        """Sequences waiting to (re)enter the pool, in order."""
        return self.scheduler.waiting

    @property
    def running(self) -> list[Seq]:
        """Sequences holding blocks."""
        return self.scheduler.running

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        """Whether a :meth:`step` would do anything."""
        return bool(self.running or self.waiting)

    # ------------------------------------------------------------------ scheduling

    def _admitted(self, seq: Seq, cached: int) -> None:
        if seq.index == 0 and not seq.output_ids:
            seq.request.cached_tokens = cached
            self.metrics.prompt_tokens += len(seq.tokens)
            self.metrics.cached_prompt_tokens += cached

    def _preempted(self, seq: Seq) -> None:
        self.runner.release(seq.seq_id)
        if self.draft is not None:
            self.draft.release(seq.seq_id)
        self.metrics.preemptions += 1

    # ------------------------------------------------------------------ offline use

    def generate(
        self,
        prompts: Iterable[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[list[CompletionDelta]]:
        """Run prompts to completion (continuous batching) and return each one's choices
        (:func:`~attnlab.serving.outputs.run_offline`: the whole text, token ids, logprobs
        and finish reason of each; a request that failed has ``finish_reason="error"``).

        Raises:
            ParamError: a request does not fit (none is queued then).
        """
        return run_offline(self, prompts, params, base=f"offline-{next(self._order)}-")
