"""The HTTP side's warm-up: the server's first requests are its own, not a client's.

The engine's paths are warmed before it reports ready
(:func:`~attnlab.serving.startup.warm_paths`); the HTTP process has first uses of its
own (the ASGI stack built on the first request, the route's first tokenisation, the first
stream through the engine pipe's reader). :class:`WarmGate` answers 503 (``warming
up``, with ``Retry-After``) to every request while :func:`warm_http` sends the server a
few requests of its own over a real socket (a completion, a streamed one, a chat
completion, ``/v1/models``, ``/health``, ``/metrics``), marked with a header the gate
lets through; then the gate opens. A client polling ``/v1/models`` for readiness (as
load tools do) so never meets a cold path. The engine counts those few requests in
``/metrics``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["WARM_HEADER", "WarmGate", "serve", "warm_http"]

log = logging.getLogger(__name__)

#: The header that marks the server's own warm-up requests.
WARM_HEADER = b"x-attnlab-warm-up"


class WarmGate:
    """Wrap ``app``: 503 for requests without :data:`WARM_HEADER` until :meth:`open`."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.is_open = False

    def open(self) -> None:
        self.is_open = True

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
    ) -> None:
        if self.is_open or scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        if any(k == WARM_HEADER for k, _ in scope.get("headers", ())):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {"message": "the server is warming up", "code": 503}})
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1")],
            }
        )
        await send({"type": "http.response.body", "body": body.encode()})


async def _request(
    host: str, port: int, method: str, path: str, body: dict[str, Any] | None, key: str | None
) -> int:
    """One HTTP/1.1 request (``Connection: close``), its body read to the end; the status."""
    reader, writer = await asyncio.open_connection(host, port)
    data = json.dumps(body).encode() if body is not None else b""
    head = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Connection: close",
            f"{WARM_HEADER.decode()}: 1", f"Content-Length: {len(data)}"]  # fmt: skip
    if body is not None:
        head.append("Content-Type: application/json")
    if key:
        head.append(f"Authorization: Bearer {key}")
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
    await writer.drain()
    status_line = await reader.readline()
    await reader.read()  # the rest, a stream included
    writer.close()
    parts = status_line.split()
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


async def warm_http(
    host: str, port: int, model: str, *, api_key: str | None = None, timeout: float = 120.0
) -> str:
    """Send the server at ``host:port`` its warm-up requests (bounded by ``timeout``
    seconds in all); returns what the log says. A failure is logged, never raised: the
    server serves anyway."""
    host = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
    text = {"model": model, "prompt": "Hello, this is the server warming up.", "max_tokens": 2}
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    calls: list[tuple[str, str, dict[str, Any] | None]] = [
        ("GET", "/v1/models", None),
        ("GET", "/health", None),
        ("POST", "/v1/completions", text),
        ("POST", "/v1/completions", {**text, "stream": True}),
        ("POST", "/v1/completions", {**text, "stream": True, "temperature": 0.0}),
        ("POST", "/v1/chat/completions", {**chat, "stream": True}),
        ("GET", "/metrics", None),
    ]
    t0 = time.perf_counter()
    statuses: list[int] = []
    try:
        async with asyncio.timeout(timeout):
            for method, path, body in calls:
                statuses.append(await _request(host, port, method, path, body, api_key))
    except (OSError, TimeoutError) as e:
        log.warning("the HTTP warm-up stopped: %s", e)
        return f"HTTP warm-up stopped after {len(statuses)} requests: {e}"
    return (
        f"HTTP side warmed with {len(statuses)} requests in {time.perf_counter() - t0:.1f} s "
        f"(statuses {' '.join(map(str, statuses))})"
    )


def serve(
    app: Any,
    sock: Any,
    *,
    host: str,
    port: int,
    model: str | None,
    api_key: str | None = None,
    warm: bool = True,
    freeze: bool = True,
) -> None:
    """Run uvicorn on the listening ``sock`` until it stops. With ``warm`` and a
    decoder's ``model`` name, answer 503 until the server's own warm-up requests went
    through it (:func:`warm_http`); then (``freeze``) freeze this process's heap
    (:func:`~attnlab.serving.startup.freeze_heap`)."""
    import sys

    import uvicorn

    from attnlab.serving.startup import freeze_heap

    gate = WarmGate(app) if warm and model is not None else None
    config = uvicorn.Config(gate or app, log_level="warning", timeout_keep_alive=75)
    server = uvicorn.Server(config)

    async def main() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        if gate is not None:
            for _ in range(600):  # until uvicorn listens (at most 60 s)
                if server.started or task.done():
                    break
                await asyncio.sleep(0.1)
            if server.started:
                said = await warm_http(host, port, model or "", api_key=api_key)
                print(said, file=sys.stderr, flush=True)
            gate.open()
        if freeze:  # the HTTP process's objects so far (the engine froze its own)
            freeze_heap()
        await task

    with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
        runner.run(main())
