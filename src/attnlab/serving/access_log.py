"""One log line per HTTP request: method, route, status, tokens, latency.

An ASGI middleware (it wraps any ASGI app, FastAPI's included) that writes, when a
response has been sent in full (streams included)::

    POST /v1/chat/completions 200 prompt=37 completion=9 0.84s

The token counts are what the route handler passed to :func:`record_usage` while it
ran (the OpenAI routes record every ``usage`` they compute, and their totals at the end
of a stream); routes that record none print ``-``. The record travels in a context
variable holding a dict that this middleware creates per request, so it reaches
handlers running in other tasks (FastAPI's middleware stack, streaming bodies).
"""

from __future__ import annotations

import contextvars
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TextIO

__all__ = ["AccessLog", "record_usage"]

_USAGE: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "attnlab_usage", default=None
)


def record_usage(usage: dict[str, int]) -> None:
    """Note the current request's token counts for its log line (no-op outside one)."""
    holder = _USAGE.get()
    if holder is not None:
        holder.update(usage)


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class AccessLog:
    """Wrap ``app``; write one line per HTTP request to ``stream`` (default stderr)."""

    def __init__(self, app: Any, *, stream: TextIO | None = None) -> None:
        self.app = app
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status: list[int] = []
        usage: dict[str, Any] = {}
        token = _USAGE.set(usage)

        async def record(message: Message) -> None:
            if message.get("type") == "http.response.start":
                status.append(int(message.get("status", 0)))
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            _USAGE.reset(token)
            self._write(scope, status[0] if status else 500, usage, time.perf_counter() - start)

    def _write(self, scope: Scope, status: int, usage: dict[str, Any], seconds: float) -> None:
        tokens = (
            f"prompt={usage.get('prompt_tokens', '-')} "
            f"completion={usage.get('completion_tokens', '-')}"
        )
        line = (
            f"{scope.get('method', '?')} {scope.get('path', '?')} {status} {tokens} {seconds:.2f}s"
        )
        stream = self.stream or sys.stderr
        print(line, file=stream, flush=True)
