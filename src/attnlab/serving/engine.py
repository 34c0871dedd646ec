"""The serving engine: the loop that calls the serving roles, one step at a time.

Requests join and leave at every step (iteration-level scheduling, Yu et al., 2022,
"Orca"). Each :meth:`Engine.step` calls, in order:

* the :class:`~attnlab.serving.scheduler.Scheduler` (torch-free): which tokens of which
  sequences run, under a token budget (decode tokens, then prefill chunks, Agrawal et
  al., 2023, "Sarathi", then new requests), their blocks reserved in the torch-free
  :class:`~attnlab.cache.paged.manager.KVManager` (block tables, prefix hashing,
  reference counts; Kwon et al., 2023); when blocks run out, the latest-arrived
  sequence is preempted and recomputed later, so no step fails for memory;
* the KV storage (:class:`~attnlab.cache.paged.storage.KVStorage`): the step's
  copy-on-write block copies;
* the :class:`~attnlab.serving.runner.ModelRunner`: one flat forward of every
  scheduled token in one ``[1, N]`` row, no padding computed, attention layers over the
  paged pool and recurrent layers over one state slot per sequence (so every decoder
  attnlab builds is served: attention, Mamba/Mamba-2/RWKV/RetNet, hybrids);
* the sampler (:func:`~attnlab.serving.step_sampling.sample_step`): one batched call
  for the sequences whose next token is due (and, with speculative decoding, for each
  drafted position, :mod:`attnlab.serving.speculative`), a failure kept to its sequence;
* the :class:`~attnlab.serving.output_processor.OutputProcessor`: detokenise, apply the
  stop rules, gather each request's news into :class:`~attnlab.serving.outputs.RequestOutput`.

The requests' lifecycle (admission checks, the ``n`` choices forked from the prompt's
blocks, aborts, the failure of one request without the others, offline runs) is the
engine's base, :class:`~attnlab.serving.lifecycle.RequestLifecycle`. It is not thread-safe: one thread calls :meth:`add_request`, :meth:`abort` and
:meth:`step`; :class:`~attnlab.serving.async_engine.AsyncEngine` runs it in a thread
beside the HTTP event loop (the matmuls release the GIL and use all cores).
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnlab._validate import check_int, check_positive_int
from attnlab.serving.draft_model import DraftRunner, load_draft_model, verify_sampled
from attnlab.serving.lifecycle import QueueFull, RequestLifecycle
from attnlab.serving.metrics import EngineMetrics
from attnlab.serving.output_processor import OutputProcessor
from attnlab.serving.outputs import CompletionDelta, Request, RequestOutput, Seq, TokenLogprob
from attnlab.serving.request_timing import gc_clock
from attnlab.serving.runner import ModelRunner, layer_specs, pool_for
from attnlab.serving.scheduler import Scheduler
from attnlab.serving.speculative import GeneratorRewind, accepted_prefix, check_speculative
from attnlab.serving.step_sampling import sample_step
from attnlab.serving.validation import check_kv_dtype, default_max_model_len

__all__ = ["CompletionDelta", "Engine", "QueueFull", "RequestOutput", "TokenLogprob"]

log = logging.getLogger(__name__)


class Engine(RequestLifecycle):
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
            ``max_position_embeddings`` (a recurrent model has none: give it).
        prefix_caching: reuse cached prompt blocks.
        kv_cache_bytes: memory cap of the default pool size.
        kv_dtype: None or ``"float"`` (the model's dtype), ``"int8"``/``"int4"`` (the
            pool stores keys and values quantized per token) or ``"int8-channel"``/
            ``"int4-channel"`` (keys per channel over each block, KIVI's layout); more
            blocks fit in ``kv_cache_bytes`` (:mod:`attnlab.cache.paged.storage`).
        speculative: None, ``"prompt_lookup"`` (each decoding sequence drafts up to
            ``num_speculative_tokens`` tokens from its context's n-grams, at most
            ``speculative_max_ngram`` long) or ``"draft"`` (``draft_model`` drafts them),
            verified in the step's forward; greedy output is what plain decoding gives,
            sampled output is distributed as it (:mod:`attnlab.serving.speculative`,
            :mod:`attnlab.serving.draft_model`).
        num_speculative_tokens: drafts per sequence and step at most.
        speculative_max_ngram: the longest n-gram prompt lookup matches.
        draft_model: with ``speculative="draft"``: a smaller attnlab decoder with the
            model's vocabulary (or its folder or ``.gguf`` file), given its own paged
            pool of as many blocks, addressed by the model's block tables.

    Raises:
        TypeError: a model (or draft model) that is not an attnlab decoder.
        ValueError: a bad setting, ``kv_dtype`` for a model without attention layers,
            ``speculative`` for a model with recurrent layers (or a draft model with
            them, another vocabulary, or a sliding-window model), or no
            ``max_model_len`` for a model whose config has no context length.
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
        kv_dtype: str | None = None,
        speculative: str | None = None,
        num_speculative_tokens: int = 4,
        speculative_max_ngram: int = 3,
        draft_model: nn.Module | str | Path | None = None,
    ) -> None:
        config = getattr(model, "config", None)
        if (
            config is None
            or getattr(model, "is_encoder_decoder", False)
            or not hasattr(model, "forward_flat")
        ):
            raise TypeError(
                f"the engine serves attnlab decoders and recurrent LMs, got {type(model).__name__}"
            )
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
        self.max_model_len = max_model_len or default_max_model_len(model)
        self.vocab_size = int(config.vocab_size)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max(max_num_batched_tokens, max_num_seqs)
        self.max_waiting = max_waiting
        specs = layer_specs(model)
        kv_dtype = check_kv_dtype(kv_dtype, specs, speculative)
        #: the speculative settings, or None
        self.speculative = check_speculative(
            speculative, num_speculative_tokens, speculative_max_ngram, specs, draft_model
        )
        #: why prefix caching is off although it was asked for, or None
        self.prefix_caching_refused: str | None = None
        if prefix_caching and "state" in specs:
            prefix_caching = False
            self.prefix_caching_refused = (
                "the model has recurrent layers: a state holds the whole prefix in one "
                "slot, so a cached prefix cannot resume without it"
            )
            log.info("prefix caching refused: %s", self.prefix_caching_refused)
        if num_blocks is None:
            probe = pool_for(
                model, specs, num_blocks=1, block_size=block_size, prefix_caching=False,
                kv_dtype=kv_dtype,
            )  # fmt: skip
            want = max_num_seqs * -(-self.max_model_len // (2 * block_size))
            per_block = probe.bytes_per_block()
            cap = kv_cache_bytes // per_block if per_block else want
            num_blocks = max(4, min(want, cap))
        self.pool = pool_for(
            model,
            specs,
            num_blocks=num_blocks,
            block_size=block_size,
            prefix_caching=prefix_caching,
            kv_dtype=kv_dtype,
        )
        self.runner = ModelRunner(model, self.pool, max_num_seqs=max_num_seqs)
        #: the draft model's runner (``speculative="draft"``), or None
        self.draft: DraftRunner | None = None
        if draft_model is not None:
            self.draft = DraftRunner(load_draft_model(draft_model, model), self.pool)
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            eos = getattr(config, "eos_token_id", None)
        eos_ids: set[int] = set() if eos is None else ({eos} if isinstance(eos, int) else set(eos))
        self.requests: dict[str, Request] = {}
        self.scheduler = Scheduler(
            self.pool.manager,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            on_admit=self._admitted,
            on_preempt=self._preempted,
            drafter=self.speculative.drafter(self.max_model_len) if self.speculative else None,
        )
        self._seq_ids = itertools.count()
        self._order = itertools.count()
        self.metrics = EngineMetrics()
        self.output = OutputProcessor(
            eos_ids=eos_ids, max_model_len=self.max_model_len, metrics=self.metrics
        )
        self._seed_source = torch.Generator().manual_seed(int(time.time_ns() % (1 << 31)))
        self._gc = gc_clock()  # the collector's pauses, per step (request_timing)

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one iteration: schedule, one forward, sample, detokenise.

        Returns:
            The news of every request that produced text or finished.
        """
        t0 = time.perf_counter()
        scheduled = self.scheduler.schedule()
        rows, drafts = scheduled.rows, scheduled.drafts
        if not rows:
            return self._collect()
        self.pool.storage.copy_blocks(scheduled.copies)
        draft_probs: dict[Any, Tensor] = {}
        if self.draft is not None:
            self.draft.copy_blocks(scheduled.copies)
            if scheduled.draft_slots:
                draft_probs = self._propose(rows, drafts, scheduled.draft_slots)
        keep = [n if seq.seq_id in drafts else 1 for seq, n in rows] if drafts else None
        # the requests whose prompt this step runs (their timings: request_timing)
        prompting = [s.request for s, _ in rows if s.index == 0 and s.request.first_token_time is None]  # fmt: skip
        gc0, kinds0, t_fwd = self._gc.seconds, self._graph_steps(), time.perf_counter()
        try:  # one flat forward of every row's tokens
            logits = self.runner.run([(seq.seq_id, n) for seq, n in rows], keep).float()  # [R, V]
        except Exception as e:  # the step's requests fail; the engine goes on
            for seq, _ in rows:
                self._fail(seq.request, f"the forward failed: {type(e).__name__}: {e}")
            return self._collect()
        t_fwd = time.perf_counter() - t_fwd
        done: list[tuple[int, Seq]] = []
        first = 0  # the row's first logits
        for seq, n in rows:
            if seq.seq_id in drafts:  # committed once verified
                done.append((first, seq))
                first += n
                continue
            self.pool.manager.commit(seq.seq_id, n)
            if seq.in_pool and self.pool.num_computed(seq.seq_id) == seq.num_tokens:
                done.append((first, seq))
            first += 1
        accepted = self.metrics.spec_accepted_tokens
        if done:
            self._sample(logits, done, drafts, draft_probs)
        if self.draft is not None:
            self.draft.settle()
        rejected = sum(map(len, drafts.values())) - self.metrics.spec_accepted_tokens + accepted
        self.metrics.record_step(
            seconds=time.perf_counter() - t0,
            tokens=sum(n for _, n in rows) - rejected,  # the tokens kept in the cache
            used=self.pool.num_used_blocks,
            total=self.pool.num_blocks,
            waste=self.pool.waste(),
            running=len(self.running),
            waiting=len(self.waiting),
        )
        if prompting:
            kind = self._step_kind(kinds0)
            gc_s, step_s = self._gc.seconds - gc0, time.perf_counter() - t0
            for req in prompting:
                req.timing.add_step(
                    start=t0, forward=t_fwd, step=step_s, gc=gc_s, kind=kind, batch=len(rows)
                )
        return self._collect()

    def _graph_steps(self) -> tuple[int, int]:
        """Steps run so far by the decode buckets and by the compiled prompt steps."""
        b, p = self.runner.buckets, self.runner.prefill
        return (b.steps if b is not None else 0, p.steps if p is not None else 0)

    def _step_kind(self, before: tuple[int, int]) -> str:
        """Which path ran the step whose forward started at ``before`` steps."""
        after = self._graph_steps()
        if after[1] > before[1]:
            return "prompt-graph"
        return "decode-graph" if after[0] > before[0] else "eager"

    def _propose(
        self, rows: list[tuple[Seq, int]], drafts: dict[Any, list[int]], slots: dict[Any, int]
    ) -> dict[Any, Tensor]:
        """The draft model's tokens for the reserved slots (a failure: no drafts this
        step); returns the draft distributions of the sampled rows."""
        assert self.draft is not None
        entries = [(seq, slots[seq.seq_id]) for seq, _ in rows if seq.seq_id in slots]
        try:
            made = self.draft.propose(entries, eos_ids=self.eos_ids, generator=self._seed_source)
        except Exception:  # the model's step goes on without drafts
            log.exception("the draft model failed; this step verifies no drafts")
            made = {}
        m = self.pool.manager
        probs: dict[Any, Tensor] = {}
        for r, (seq, _) in enumerate(rows):
            if seq.seq_id not in slots:
                continue
            d, q = made.get(seq.seq_id, ([], None))
            m.append_tokens(seq.seq_id, d)
            m.truncate(seq.seq_id, m.num_tokens(seq.seq_id))  # unused slots go back
            rows[r] = (seq, 1 + len(d))
            if d:
                drafts[seq.seq_id] = d
                if q is not None:
                    probs[seq.seq_id] = q
        return probs

    def _fork(self, seq: Seq) -> list[Seq]:
        """``seq`` and, at a request's first token, its ``n - 1`` forked choices."""
        req = seq.request
        if seq.index != 0 or req.params.n == 1 or req.forked:
            return [seq]
        req.forked = True
        children = [self._new_seq(req, i) for i in range(1, req.params.n)]
        for child in children:
            self.pool.fork(seq.seq_id, child.seq_id)
            self.runner.fork(seq.seq_id, child.seq_id)
            if self.draft is not None:
                self.draft.fork(seq.seq_id, child.seq_id)
            child.in_pool = True
            self.running.append(child)
        return [seq, *children]

    def _sample(
        self,
        logits: Tensor,
        done: list[tuple[int, Seq]],
        drafts: dict[Any, list[int]],
        draft_probs: dict[Any, Tensor],
    ) -> None:
        order: list[int] = []  # the logits row of each sampled position
        seqs: list[Seq] = []
        extras: list[list[int]] = []  # the drafts before each position
        rewind: dict[int, GeneratorRewind] = {}
        for r, seq in done:
            d = drafts.get(seq.seq_id, [])
            if seq.seq_id in draft_probs:  # a sampled row's model drafts: the rejection rule
                a, res = verify_sampled(
                    logits[r : r + len(d) + 1], seq, d, draft_probs[seq.seq_id],
                    eos_ids=self.eos_ids, generator=self._seed_source,
                )  # fmt: skip
                self._accept(seq, d, res, None, accepted=a)
                continue
            for s in self._fork(seq) if not d else [seq]:
                for j in range(len(d) + 1):
                    order.append(r + j)
                    seqs.append(s)
                    extras.append(d[:j])
            if d and seq.generator is not None and not seq.request.params.greedy:
                rewind[seq.seq_id] = GeneratorRewind(seq.generator, logits.shape[-1])
        if not order:
            return
        if order != list(range(logits.shape[0])):  # not every row once, in order: a copy
            logits = logits[order]
        results = sample_step(
            logits, seqs, eos_ids=self.eos_ids, generator=self._seed_source,
            extras=extras if drafts else None,
        )  # fmt: skip
        i = 0
        while i < len(seqs):
            s = seqs[i]
            d = drafts.get(s.seq_id, [])
            self._accept(s, d, results[i : i + len(d) + 1], rewind.get(s.seq_id))
            i += len(d) + 1

    def _accept(
        self,
        s: Seq,
        d: list[int],
        results: list[Any],
        rewind: GeneratorRewind | None,
        *,
        accepted: int | None = None,
    ) -> None:
        """Keep ``s``'s verified drafts and the token after them (no drafts: one token);
        ``accepted``: how many drafts the rejection rule kept (default: the prefix of
        drafts equal to the chosen tokens)."""
        if s.request.error is not None:
            return
        a = accepted_prefix(d, [res.token for res in results]) if accepted is None else accepted
        if results[a].error is not None:
            self._fail(s.request, results[a].error)
            return
        if d:
            self.pool.manager.commit(s.seq_id, 1 + a)  # the last token and the kept drafts
            self.pool.manager.truncate(s.seq_id, self.pool.num_computed(s.seq_id))
            self.metrics.record_speculation(drafted=len(d), accepted=a)
            if rewind is not None:
                rewind.keep(a + 1)
        for j, res in enumerate(results[: a + 1]):
            lp = None
            if res.logprobs is not None:
                lp = TokenLogprob(res.token, res.logprobs[0], res.logprobs[1])
            try:  # a grammar or detokeniser fault fails this request alone
                if self._append(s, res.token, lp, grow=j == a):
                    return
            except Exception as e:
                self._fail(s.request, f"{type(e).__name__}: {e}")
                return

    def _append(self, seq: Seq, tok: int, lp: TokenLogprob | None, *, grow: bool = True) -> bool:
        """Output ``tok``; True when ``seq`` finished with it (its blocks are freed)."""
        reason = self.output.process(seq, tok, lp)
        if reason is not None:
            seq.finish_reason = reason
            self._drop(seq)
            return True
        if grow:
            self.pool.append_tokens(seq.seq_id, [tok])
        return False

    def _collect(self) -> list[RequestOutput]:
        return self.output.collect(self.requests)
