"""One log line per HTTP request: method, route, status, tokens, latency.

An ASGI middleware (it wraps any ASGI app, FastAPI's included) that writes, when a
response has been sent in full (streams included)::

    POST /v1/chat/completions 200 prompt=37 completion=9 0.84s first_byte=41ms to_engine=2ms
    queue=0ms prompt=22ms(prompt-graph x1, batch 1) step=24ms first=31ms gc=0/0ms

(one line). The token counts are what the route handler passed to :func:`record_usage`
while it ran (the OpenAI routes record every ``usage`` they compute, and their totals at
the end of a stream); routes that record none print ``-``. ``first_byte`` is when the
response's first body bytes left (a stream's first token). The rest is the engine's
account of the request's way to its first token, passed to :func:`record_timings`
(:mod:`attnlab.serving.request_timing`): ``to_engine`` from the HTTP request's arrival
to the engine's, ``queue``, the prompt's forward time and the path that ran it, its
steps' whole time, the engine's first token, and the collector's pauses in the engine
process during the prompt's steps / in this process during the request. The record travels in a context
variable holding a dict that this middleware creates per request, so it reaches
handlers running in other tasks (FastAPI's middleware stack, streaming bodies).
"""

from __future__ import annotations

import contextvars
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TextIO

__all__ = ["AccessLog", "record_timings", "record_usage"]

_USAGE: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "attnlab_usage", default=None
)


def record_usage(usage: dict[str, int]) -> None:
    """Note the current request's token counts for its log line (no-op outside one)."""
    holder = _USAGE.get()
    if holder is not None:
        holder.update(usage)


def record_timings(timings: dict[str, Any]) -> None:
    """Note the engine's timings of the current request (of several prompts: the one
    whose first token came last) for its log line (no-op outside one)."""
    holder = _USAGE.get()
    if holder is None:
        return
    have = holder.get("_timings")
    if have is None or timings.get("first_ms", 0.0) > have.get("first_ms", 0.0):
        holder["_timings"] = timings


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class AccessLog:
    """Wrap ``app``; write one line per HTTP request to ``stream`` (default stderr)."""

    def __init__(self, app: Any, *, stream: TextIO | None = None) -> None:
        from attnlab.serving.request_timing import gc_clock

        self.app = app
        self.stream = stream
        self._gc = gc_clock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        gc0 = self._gc.seconds
        status: list[int] = []
        usage: dict[str, Any] = {}
        token = _USAGE.set(usage)

        async def record(message: Message) -> None:
            kind = message.get("type")
            if kind == "http.response.start":
                status.append(int(message.get("status", 0)))
            elif kind == "http.response.body" and message.get("body") and "_first" not in usage:
                usage["_first"] = time.perf_counter()
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            _USAGE.reset(token)
            usage["_gc"] = self._gc.seconds - gc0
            self._write(scope, status[0] if status else 500, usage, start)

    def _write(self, scope: Scope, status: int, usage: dict[str, Any], start: float) -> None:
        seconds = time.perf_counter() - start
        tokens = (
            f"prompt={usage.get('prompt_tokens', '-')} "
            f"completion={usage.get('completion_tokens', '-')}"
        )
        line = (
            f"{scope.get('method', '?')} {scope.get('path', '?')} {status} {tokens} {seconds:.2f}s"
        )
        if "_first" in usage:
            line += f" first_byte={(usage['_first'] - start) * 1e3:.0f}ms"
        t = usage.get("_timings")
        if t is not None:
            line += " " + _engine_part(t, start, usage["_gc"])
        stream = self.stream or sys.stderr
        print(line, file=stream, flush=True)


def _engine_part(t: dict[str, Any], start: float, http_gc: float) -> str:
    """The engine's timings of a request as ``key=value`` fields."""
    parts = [f"to_engine={(t['arrival'] - start) * 1e3:.0f}ms"]
    if "queue_ms" in t:
        parts += [
            f"queue={t['queue_ms']:.0f}ms",
            f"prompt={t['prompt_ms']:.0f}ms({t['kind']} x{t['prompt_steps']}, batch {t['batch']})",
            f"step={t['step_ms']:.0f}ms",
        ]
    if "first_ms" in t:
        parts.append(f"first={t['first_ms']:.0f}ms")
    parts.append(f"gc={t.get('gc_ms', 0.0):.0f}/{http_gc * 1e3:.0f}ms")
    return " ".join(parts)
