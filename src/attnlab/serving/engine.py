"""The serving engine: continuous batching over a paged KV cache.

Requests join and leave at every step (iteration-level scheduling, Yu et al., 2022,
"Orca"). Each :meth:`Engine.step` builds one batch under a token budget: first one
token for every decoding sequence, then chunks of prompts still being prefilled
(chunked prefill, Agrawal et al., 2023, "Sarathi"), then new requests in arrival
order while blocks and budget last. Keys/values live in a
:class:`~attnlab.cache.paged.PagedKVPool` (Kwon et al., 2023): a prompt whose leading
blocks are cached is not recomputed, the ``n`` choices of a request share the
prompt's blocks (copy-on-write), and when the pool runs out the latest-arrived
running sequence is preempted: its blocks are freed and it is recomputed later from
its tokens, so no sequence is ever corrupted and the engine never fails for memory.

The step runs the one model forward (a left-padded batch with an ``attention_mask``;
see :mod:`attnlab.cache.paged.pool`), so the engine adds no attention math of its
own and serves every decoder attnlab builds.

Threads: the engine is not thread-safe; one thread calls :meth:`add_request`,
:meth:`abort` and :meth:`step`. :class:`~attnlab.serving.async_engine.AsyncEngine`
runs it in a dedicated thread beside the HTTP event loop: the model's matmuls release
the GIL and use torch's intra-op threads (all cores), while the event loop thread
wakes only to parse requests and write server-sent events.
"""

from __future__ import annotations

import itertools
import logging
import numbers
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from attnlab._validate import check_int, check_positive_int
from attnlab.cache.paged import OutOfBlocks, PagedKVPool
from attnlab.serving.detokenize import IncrementalDetokenizer
from attnlab.serving.metrics import EngineMetrics
from attnlab.serving.params import ParamError, SamplingParams
from attnlab.serving.step_sampling import sample_step

__all__ = ["CompletionDelta", "Engine", "QueueFull", "RequestOutput"]

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The waiting queue is full (the server answers 429)."""


@dataclass
class TokenLogprob:
    """The log-probability of a chosen token and of the most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class CompletionDelta:
    """What one choice produced since the last output.

    Attributes:
        index: the choice's index (``0..n-1``).
        text: new text (complete UTF-8 characters only).
        token_ids: new token ids.
        logprobs: one entry per new token when requested.
        finish_reason: ``"stop"`` (EOS, a stop string or token, a complete grammar),
            ``"length"``, ``"abort"``, ``"error"``, or None.
        error: why the request failed (with ``finish_reason="error"``; offline results).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class RequestOutput:
    """One step's news for one request.

    Attributes:
        request_id: the request.
        outputs: the choices that changed.
        finished: every choice is done.
        prompt_tokens: prompt length.
        cached_tokens: prompt tokens taken from the prefix cache.
        error: why the request failed inside a step (it alone; the engine goes on).
    """

    request_id: str
    outputs: list[CompletionDelta]
    finished: bool
    prompt_tokens: int
    cached_tokens: int = 0
    error: str | None = None


@dataclass
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    order: int
    seqs: list[_Seq] = field(default_factory=list)
    forked: bool = False
    cached_tokens: int = 0
    first_token_time: float | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.error is not None or (
            bool(self.seqs)
            and all(s.finish_reason is not None for s in self.seqs)
            and (self.forked or self.params.n == 1)
        )


@dataclass
class _Seq:
    seq_id: int
    request: _Request
    index: int
    generator: torch.Generator | None
    detok: IncrementalDetokenizer
    output_ids: list[int] = field(default_factory=list)
    text: str = ""  # all text so far (stop strings cut)
    sent: int = 0  # characters of ``text`` already returned
    finish_reason: str | None = None
    in_pool: bool = False
    pending: CompletionDelta | None = None
    matcher: Any = None  # the grammar's parser state (a GrammarMatcher) or None

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_ids + self.output_ids


class Engine:
    """Continuous batching with a paged KV cache, for any attnlab decoder.

    Args:
        model: an attnlab causal LM (:class:`~attnlab.models.decoder.DecoderLM`).
        tokenizer: a transformers tokenizer (``encode``/``decode``, ``eos_token_id``).
        num_blocks: KV blocks in the pool; default: enough for ``max_num_seqs``
            sequences of half the context, at most ``kv_cache_bytes``.
        block_size: tokens per block.
        max_num_seqs: the most sequences in one step.
        max_num_batched_tokens: the token budget of a step (decode tokens first, then
            prefill chunks).
        max_waiting: the most queued requests; beyond it :meth:`add_request` raises
            :class:`QueueFull`.
        max_model_len: context length (prompt + output); default the model's
            ``max_position_embeddings``.
        prefix_caching: reuse cached prompt blocks.
        kv_cache_bytes: memory cap of the default pool size.

    Raises:
        TypeError: a model that is not an attnlab decoder.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        num_blocks: int | None = None,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        max_waiting: int = 256,
        max_model_len: int | None = None,
        prefix_caching: bool = True,
        kv_cache_bytes: int = 1 << 30,
    ) -> None:
        config = getattr(model, "config", None)
        if (
            config is None
            or getattr(model, "is_encoder_decoder", False)
            or not hasattr(model, "new_cache")
        ):
            raise TypeError(f"the engine serves attnlab decoders, got {type(model).__name__}")
        for name, value in (
            ("block_size", block_size),
            ("max_num_seqs", max_num_seqs),  # 0 would never admit a request: a hang
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("kv_cache_bytes", kv_cache_bytes),
        ):
            check_positive_int(name, value)
        check_int("max_waiting", max_waiting, min_value=0)
        if num_blocks is not None:
            check_positive_int("num_blocks", num_blocks)
        if max_model_len is not None:
            check_positive_int("max_model_len", max_model_len)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_model_len = int(max_model_len or config.max_position_embeddings)
        self.vocab_size = int(config.vocab_size)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max(max_num_batched_tokens, max_num_seqs)
        self.max_waiting = max_waiting
        if num_blocks is None:
            probe = PagedKVPool.for_model(model, num_blocks=1, block_size=block_size)
            want = max_num_seqs * -(-self.max_model_len // (2 * block_size))
            num_blocks = max(4, min(want, kv_cache_bytes // probe.bytes_per_block()))
        self.pool = PagedKVPool.for_model(
            model, num_blocks=num_blocks, block_size=block_size, prefix_caching=prefix_caching
        )
        self.cache = self.pool.model_cache()
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            eos = getattr(config, "eos_token_id", None)
        self.eos_ids: set[int] = (
            set() if eos is None else ({eos} if isinstance(eos, int) else set(eos))
        )
        self.requests: dict[str, _Request] = {}
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self._seq_ids = itertools.count()
        self._order = itertools.count()
        self.metrics = EngineMetrics()
        self._seed_source = torch.Generator().manual_seed(int(time.time_ns() % (1 << 31)))

    # ------------------------------------------------------------------ requests

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Check a request against the context; raise :class:`ParamError` naming the field."""
        vocab = self.vocab_size
        if len(prompt_ids) == 0:
            raise ParamError("prompt", "the prompt is empty")
        bad = next(
            (t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)),
            None,
        )
        if bad is not None:  # int(1.7) would silently make it token 1
            raise ParamError(
                "prompt", f"token ids must be ints, got {bad!r} ({type(bad).__name__})"
            )
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ParamError("prompt", f"token ids must lie in [0, {vocab})")
        for name, ids in (
            ("logit_bias", [t for t, _ in params.logit_bias]),
            ("stop_token_ids", params.stop_token_ids),
        ):
            if any(t >= vocab for t in ids):
                raise ParamError(
                    name, f"{name}: token ids must lie in [0, {vocab}), got {max(ids)}"
                )
        grammar = params.grammar
        if grammar is not None and getattr(grammar, "vocab_size", vocab) != vocab:
            raise ParamError(
                "response_format",
                f"the grammar was compiled for {grammar.vocab_size} tokens, the model has {vocab}",
            )
        if len(prompt_ids) >= self.max_model_len:
            raise ParamError(
                "prompt",
                f"the prompt has {len(prompt_ids)} tokens; the context is {self.max_model_len}, "
                "which leaves no room for a completion",
            )
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ParamError(
                "max_tokens",
                f"max_tokens={params.max_tokens} with a {len(prompt_ids)}-token prompt exceeds "
                f"the context of {self.max_model_len} tokens",
            )
        blocks = -(-(len(prompt_ids) + params.max_tokens) // self.pool.block_size)
        if blocks > self.pool.num_blocks:
            raise ParamError(
                "max_tokens",
                f"the request needs {blocks} KV blocks, the pool has {self.pool.num_blocks}",
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
        req = _Request(request_id, ids, params, time.perf_counter(), next(self._order))
        self.requests[request_id] = req
        seq = self._new_seq(req, 0)
        self.waiting.append(seq)
        self.metrics.requests_received += 1

    def _new_seq(self, req: _Request, index: int) -> _Seq:
        gen = None
        p = req.params
        if not p.greedy and p.seed is not None:  # seed <= 2**63 - 1: seed + index fits torch
            gen = torch.Generator().manual_seed(p.seed + index)
        seq = _Seq(
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

    def _fail(self, req: _Request, error: str) -> None:
        """Fail one request inside a step: free its blocks, keep the error for its client."""
        if req.error is not None:
            return
        log.warning("request %s failed: %s", req.request_id, error)
        req.error = error
        for seq in req.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = "error"
            self._drop(seq)

    def _drop(self, seq: _Seq) -> None:
        if seq.in_pool:
            self.pool.free(seq.seq_id)
            seq.in_pool = False
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)

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

    def _preempt(self, rows: list[tuple[_Seq, int]]) -> _Seq:
        """Free the lowest-priority (latest-arrived) running sequence; recompute it later."""
        victim = max(self.running, key=lambda s: (s.request.order, s.index))
        self.running.remove(victim)
        self.pool.free(victim.seq_id)
        victim.in_pool = False
        self.waiting.appendleft(victim)
        rows[:] = [r for r in rows if r[0] is not victim]
        self.metrics.preemptions += 1
        log.debug("preempted sequence %d of %s", victim.seq_id, victim.request.request_id)
        return victim

    def _schedule(self) -> list[tuple[_Seq, int]]:
        budget = self.max_num_batched_tokens
        rows: list[tuple[_Seq, int]] = []
        pending = {
            s.seq_id: self.pool.num_tokens(s.seq_id) - self.pool.num_computed(s.seq_id)
            for s in self.running
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
                    self.pool.reserve(seq.seq_id, n)
                    rows.append((seq, n))
                    budget -= n
                    break
                except OutOfBlocks:
                    if self._preempt(rows) is seq:
                        break
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.pool.add_sequence(seq.seq_id, seq.tokens)
            n = min(len(seq.tokens) - cached, budget)
            spare = len(self.running)  # a block of room for each running sequence to grow
            if (
                self.pool.blocks_needed(seq.seq_id, n) + spare > self.pool.num_free_blocks
                and self.running
            ):
                self.pool.free(seq.seq_id)
                break
            try:
                self.pool.reserve(seq.seq_id, n)
            except OutOfBlocks:
                self.pool.free(seq.seq_id)
                break
            self.waiting.popleft()
            seq.in_pool = True
            if seq.index == 0 and not seq.output_ids:
                seq.request.cached_tokens = cached
                self.metrics.prompt_tokens += len(seq.tokens)
                self.metrics.cached_prompt_tokens += cached
            self.running.append(seq)
            rows.append((seq, n))
            budget -= n
        return rows

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one iteration: schedule, one forward, sample, detokenise.

        Returns:
            The news of every request that produced text or finished.
        """
        t0 = time.perf_counter()
        rows = self._schedule()
        if not rows:
            return self._collect()
        logits = torch.empty(len(rows), self.vocab_size)
        for group in self._groups(rows):
            batch = self.pool.begin_step([(rows[r][0].seq_id, rows[r][1]) for r in group])
            try:
                out = self.model(
                    batch.input_ids,
                    attention_mask=batch.attention_mask,
                    past_key_values=self.cache,
                    logits_to_keep=1,
                ).logits[:, -1]  # [b, V]
            except Exception as e:  # this forward's requests fail; the other groups go on
                self.pool.end_step()
                for r in group:
                    self._fail(rows[r][0].request, f"the forward failed: {type(e).__name__}: {e}")
                continue
            self.pool.end_step()
            logits[group] = out.float()
        done = [
            (r, seq)
            for r, (seq, _n) in enumerate(rows)
            if seq.in_pool and self.pool.num_computed(seq.seq_id) == len(seq.tokens)
        ]
        if done:
            self._sample(logits, done)
        self.metrics.record_step(
            seconds=time.perf_counter() - t0,
            tokens=sum(n for _, n in rows),
            used=self.pool.num_used_blocks,
            total=self.pool.num_blocks,
            waste=self.pool.waste(),
            running=len(self.running),
            waiting=len(self.waiting),
        )
        return self._collect()

    @staticmethod
    def _groups(rows: list[tuple[_Seq, int]]) -> list[list[int]]:
        """Split a step's rows into forwards whose padding stays small.

        A forward pads every row to the longest row's new tokens, so the decode rows (one
        token each) run together, and prefill chunks, longest first, join a forward only
        while the padded size stays within 1.25x the tokens it holds.
        """
        decode = [r for r, (_, n) in enumerate(rows) if n == 1]
        chunks = sorted((r for r, (_, n) in enumerate(rows) if n > 1), key=lambda r: -rows[r][1])
        groups = [decode] if decode else []
        current: list[int] = []
        held = 0
        for r in chunks:
            n = rows[r][1]
            width = rows[current[0]][1] if current else n
            if current and (len(current) + 1) * width > 1.25 * (held + n):
                groups.append(current)
                current, held = [], 0
            current.append(r)
            held += n
        if current:
            groups.append(current)
        return groups

    def _sample(self, logits: Tensor, done: list[tuple[int, _Seq]]) -> None:
        pairs: list[tuple[int, _Seq]] = []
        for r, seq in done:
            req = seq.request
            p = req.params
            if seq.index == 0 and p.n > 1 and not req.forked:
                req.forked = True
                children = [self._new_seq(req, i) for i in range(1, p.n)]
                for child in children:
                    self.pool.fork(seq.seq_id, child.seq_id)
                    child.in_pool = True
                    self.running.append(child)
                pairs += [(r, s) for s in (seq, *children)]
            else:
                pairs.append((r, seq))
        seqs = [s for _, s in pairs]
        results = sample_step(
            logits[[r for r, _ in pairs]], seqs, eos_ids=self.eos_ids, generator=self._seed_source
        )
        for s, res in zip(seqs, results, strict=True):
            if s.request.error is not None:
                continue
            if res.error is not None:
                self._fail(s.request, res.error)
                continue
            lp = None
            if res.logprobs is not None:
                lp = TokenLogprob(res.token, res.logprobs[0], res.logprobs[1])
            try:
                self._append(s, res.token, lp)
            except Exception as e:  # a grammar or detokeniser fault fails this request alone
                self._fail(s.request, f"{type(e).__name__}: {e}")

    def _append(self, seq: _Seq, tok: int, lp: TokenLogprob | None) -> None:
        req, p = seq.request, seq.request.params
        now = time.perf_counter()
        if req.first_token_time is None:
            req.first_token_time = now
            self.metrics.record_ttft(now - req.arrival)
        self.metrics.generation_tokens += 1
        seq.output_ids.append(tok)
        delta = seq.pending or CompletionDelta(index=seq.index)
        seq.pending = delta
        delta.token_ids.append(tok)
        if lp is not None:
            delta.logprobs.append(lp)
        reason = None
        if seq.matcher is not None:
            seq.matcher.advance(tok)
        if tok in self.eos_ids and not p.ignore_eos:
            reason = "stop"
        elif tok in p.stop_token_ids:
            reason = "stop"
            if p.include_stop_str_in_output:
                seq.text += seq.detok.add(tok) + seq.detok.flush()
        else:
            seq.text += seq.detok.add(tok)
        if reason is None and p.stop and len(seq.output_ids) >= p.min_tokens:
            cut = self._find_stop(seq.text, p.stop, keep=p.include_stop_str_in_output)
            if cut is not None:
                seq.text = seq.text[:cut]
                reason = "stop"
        if reason is None and seq.matcher is not None and seq.matcher.done:
            seq.text += seq.detok.flush()
            reason = "stop"
        if reason is None and (
            len(seq.output_ids) >= p.max_tokens or len(seq.tokens) >= self.max_model_len
        ):
            reason = "length"
        if reason is not None:
            if reason == "length":
                seq.text += seq.detok.flush()
            self._finish(seq, reason)
        else:
            self.pool.append_tokens(seq.seq_id, [tok])

    @staticmethod
    def _find_stop(text: str, stops: tuple[str, ...], *, keep: bool = False) -> int | None:
        """Where the text ends at its first stop string (after it when ``keep``), or None."""
        hits = [(i, i + len(s) if keep else i) for s in stops if (i := text.find(s)) >= 0]
        return min(hits)[1] if hits else None

    def _finish(self, seq: _Seq, reason: str) -> None:
        seq.finish_reason = reason
        self._drop(seq)

    def _collect(self) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        for rid, req in list(self.requests.items()):
            deltas: list[CompletionDelta] = []
            for seq in req.seqs:
                d = seq.pending
                hold = 0
                if seq.finish_reason is None and req.params.stop:
                    hold = max(len(s) for s in req.params.stop) - 1
                upto = max(seq.sent, len(seq.text) - hold)
                if d is None and upto == seq.sent and seq.finish_reason is None:
                    continue
                d = d or CompletionDelta(index=seq.index)
                d.text = seq.text[seq.sent : upto]
                seq.sent = upto
                if seq.finish_reason is not None and seq.sent == len(seq.text):
                    d.finish_reason = seq.finish_reason
                seq.pending = None
                if d.token_ids or d.text or d.finish_reason:
                    deltas.append(d)
            finished = req.finished
            if deltas or finished:
                outs.append(
                    RequestOutput(
                        rid, deltas, finished, len(req.prompt_ids), req.cached_tokens, req.error
                    )
                )
            if finished:
                del self.requests[rid]
                self.metrics.requests_finished += 1
        return outs

    # ------------------------------------------------------------------ offline use

    def generate(
        self,
        prompts: Iterable[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[list[CompletionDelta]]:
        """Run prompts to completion (continuous batching) and return each one's choices.

        Returns:
            For each prompt, its ``n`` choices, each as one :class:`CompletionDelta` with
            the whole text, token ids, logprobs and finish reason. A request that failed
            inside a step has ``finish_reason="error"`` and the reason in ``error``; the
            others run to completion as if it had not been there.

        Raises:
            ParamError: a request does not fit (none is queued then).
        """
        prompts = list(prompts)
        plist = (
            list(params)
            if isinstance(params, Sequence)
            else [params or SamplingParams()] * len(prompts)
        )
        base = f"offline-{next(self._order)}-"
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        for prompt, p in zip(prompts, plist, strict=True):  # all checked before any is queued
            self.validate(
                self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt), p
            )
        for i, (prompt, p) in enumerate(zip(prompts, plist, strict=True)):
            self.add_request(f"{base}{i}", prompt, p)
        results: dict[str, dict[int, CompletionDelta]] = {
            f"{base}{i}": {} for i in range(len(prompts))
        }
        while self.has_work():
            for out in self.step():
                acc = results.get(out.request_id)
                if acc is None:
                    continue
                for d in out.outputs:
                    have = acc.setdefault(d.index, CompletionDelta(index=d.index))
                    have.text += d.text
                    have.token_ids += d.token_ids
                    have.logprobs += d.logprobs
                    have.finish_reason = d.finish_reason or have.finish_reason
                    have.error = out.error
        return [
            [acc[i] for i in sorted(acc)]
            for acc in (results[f"{base}{j}"] for j in range(len(prompts)))
        ]
