"""What the engine hands back, and the state it keeps per request and per choice.

The public outputs (:class:`RequestOutput` of :class:`CompletionDelta` of
:class:`TokenLogprob`) are what :meth:`~attnlab.serving.engine.Engine.step` returns and
what the HTTP handlers turn into OpenAI responses. :class:`Request` and :class:`Seq` are
the engine's bookkeeping: a request has ``n`` choices, each a :class:`Seq` the scheduler
runs, the sampler extends and the output processor turns into text.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from attnlab.serving.detokenize import IncrementalDetokenizer
from attnlab.serving.params import SamplingParams
from attnlab.serving.request_timing import RequestTiming

__all__ = [
    "CompletionDelta",
    "Request",
    "RequestOutput",
    "Seq",
    "TokenLogprob",
    "read_stream",
    "run_offline",
]


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
        timings: on the last output, where its time to first token went
            (:meth:`~attnlab.serving.request_timing.RequestTiming.summary`), else None.
    """

    request_id: str
    outputs: list[CompletionDelta]
    finished: bool
    prompt_tokens: int
    cached_tokens: int = 0
    error: str | None = None
    timings: dict[str, Any] | None = None


@dataclass(eq=False)  # identity: the scheduler looks sequences up in lists
class Request:
    """A request in the engine: its prompt, parameters and choices."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    order: int
    seqs: list[Seq] = field(default_factory=list)
    forked: bool = False
    cached_tokens: int = 0
    first_token_time: float | None = None
    error: str | None = None
    timing: RequestTiming = field(default_factory=RequestTiming)

    @property
    def finished(self) -> bool:
        return self.error is not None or (
            bool(self.seqs)
            and all(s.finish_reason is not None for s in self.seqs)
            and (self.forked or self.params.n == 1)
        )


@dataclass(eq=False)  # identity: a field-by-field == per lookup is slow
class Seq:
    """One choice of a request: the sequence the scheduler runs and the sampler extends."""

    seq_id: int
    request: Request
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
    lookup: Any = None  # the prompt-lookup n-gram index (speculative decoding) or None

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """``len(tokens)``, without building the list."""
        return len(self.request.prompt_ids) + len(self.output_ids)


def run_offline(
    engine: Any,
    prompts: Iterable[str | Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] | None,
    *,
    base: str,
) -> list[list[CompletionDelta]]:
    """:meth:`Engine.generate <attnlab.serving.engine.Engine.generate>`: queue every
    prompt (all checked before any is queued) under ids ``base + i``, step until done,
    and join each choice's deltas into one.

    Returns:
        For each prompt, its ``n`` choices, each as one :class:`CompletionDelta` with
        the whole text, token ids, logprobs and finish reason. A request that failed
        inside a step has ``finish_reason="error"`` and the reason in ``error``; the
        others run to completion as if it had not been there.
    """
    prompts = list(prompts)
    plist = (
        list(params)
        if isinstance(params, Sequence)
        else [params or SamplingParams()] * len(prompts)
    )
    if len(plist) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
    for prompt, p in zip(prompts, plist, strict=True):
        engine.validate(
            engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt), p
        )
    for i, (prompt, p) in enumerate(zip(prompts, plist, strict=True)):
        engine.add_request(f"{base}{i}", prompt, p)
    results: dict[str, dict[int, CompletionDelta]] = {f"{base}{i}": {} for i in range(len(prompts))}
    while engine.has_work():
        for out in engine.step():
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


async def read_stream(
    q: asyncio.Queue[Any], on_close: Callable[[bool], None]
) -> AsyncGenerator[RequestOutput, None]:
    """Yield one request's outputs from its queue, up to and including the finished one.

    An exception put on the queue is raised. ``on_close(finished)`` runs however the
    iteration ends: ``finished`` is False when the consumer left early (a dropped client),
    so the caller aborts the request and frees its blocks. Both engine front ends (the
    in-process :class:`~attnlab.serving.async_engine.AsyncEngine` and the
    :class:`~attnlab.serving.engine_client.EngineProcess` client) stream through it.
    """
    finished = False
    try:
        while True:
            item = await q.get()
            if isinstance(item, BaseException):
                finished = True
                raise item
            yield item
            if item.finished:
                finished = True
                return
    finally:
        on_close(finished)
