"""One log line per HTTP request: method, route, status, tokens, latency.

An ASGI middleware (it wraps any ASGI app, FastAPI's included) that writes, when a
response has been sent in full (streams included)::

    POST /v1/chat/completions 200 prompt=37 completion=9 0.84s

The token counts are what a route handler left in ``scope["attnlab.usage"]`` (the
OpenAI routes put their ``usage`` there); routes without one print ``-``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TextIO

__all__ = ["USAGE_KEY", "AccessLog"]

#: the ASGI scope key where route handlers leave ``{"prompt_tokens": ..., "completion_tokens": ...}``
USAGE_KEY = "attnlab.usage"

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

        async def record(message: Message) -> None:
            if message.get("type") == "http.response.start":
                status.append(int(message.get("status", 0)))
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            self._write(scope, status[0] if status else 500, time.perf_counter() - start)

    def _write(self, scope: Scope, status: int, seconds: float) -> None:
        usage = scope.get(USAGE_KEY) or {}
        tokens = (
            f"prompt={usage.get('prompt_tokens', '-')} "
            f"completion={usage.get('completion_tokens', '-')}"
        )
        line = (
            f"{scope.get('method', '?')} {scope.get('path', '?')} {status} {tokens} {seconds:.2f}s"
        )
        stream = self.stream or sys.stderr
        print(line, file=stream, flush=True)
