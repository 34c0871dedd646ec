"""The engine in a dedicated thread, driven from an asyncio event loop.

How the engine and the HTTP loop share the cores: the engine thread owns the
:class:`~attnlab.serving.engine.Engine` and runs :meth:`Engine.step` back to back while
there is work (and sleeps on a queue when there is none). The model's matmuls release
the GIL and use torch's intra-op thread pool, so a step uses every core; the event
loop thread needs the CPU only briefly, to parse a request or write a server-sent
event, which it gets while the engine thread is inside torch. Requests and aborts
cross from the loop to the engine through a thread-safe inbox, read between steps;
outputs cross back with ``loop.call_soon_threadsafe`` into one asyncio queue per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

from attnlab.serving.engine import Engine, QueueFull, RequestOutput
from attnlab.serving.engine_core import metrics_text
from attnlab.serving.outputs import read_stream
from attnlab.serving.params import SamplingParams

__all__ = ["AsyncEngine"]

log = logging.getLogger(__name__)


class AsyncEngine:
    """Runs an :class:`Engine` in a thread; :meth:`generate` streams a request's outputs.

    Args:
        engine: the engine (used only by the engine thread from :meth:`start` on).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._queued = 0  # requests sent to the inbox, not yet admitted by the engine thread
        self._lock = threading.Lock()
        self.error: BaseException | None = None

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="attnlab-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread after its current step."""
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # what the HTTP handlers read (as :class:`~attnlab.serving.engine_client.EngineProcess`)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return int(self.engine.vocab_size)

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Check a request against the context; raise ``ParamError`` naming the field."""
        self.engine.validate(prompt_ids, params)

    async def metrics_text(self) -> str:
        """``/metrics`` now (read from the engine between or during steps: counters only)."""
        return metrics_text(self.engine)

    def _deliver(self, request_id: str, item: Any) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return
        loop, q = target
        with contextlib.suppress(RuntimeError):  # the loop has closed
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "add":
            rid, prompt, params = payload
            with self._lock:
                self._queued -= 1
            try:
                self.engine.add_request(rid, prompt, params)
            except Exception as e:  # the request fails, the engine goes on
                self._deliver(rid, e)
        elif kind == "abort":
            self.engine.abort(payload)

    def _run(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                block = not eng.has_work()
                try:
                    kind, payload = self._inbox.get(block=block, timeout=0.5 if block else None)
                    self._handle(kind, payload)
                    while True:
                        kind, payload = self._inbox.get_nowait()
                        self._handle(kind, payload)
                except queue.Empty:
                    pass
                if self._stop.is_set() or not eng.has_work():
                    continue
                for out in eng.step():
                    self._deliver(out.request_id, out)
        except BaseException as e:  # a bug: fail every open stream rather than hang them
            log.exception("the engine thread failed")
            self.error = e
            for rid in list(self._streams):
                self._deliver(rid, RuntimeError(f"the engine failed: {e}"))

    def check_capacity(self) -> None:
        """Raise :class:`QueueFull` when no more requests can be queued."""
        with self._lock:
            queued = self._queued
        if self.engine.num_waiting + queued >= self.engine.max_waiting:
            raise QueueFull(
                f"{self.engine.num_waiting + queued} requests are waiting "
                f"(max_waiting={self.engine.max_waiting})"
            )

    async def generate(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs until it finishes.

        Leaving the iteration early (a client that disconnected) aborts the request and
        frees its blocks.

        Raises:
            QueueFull: the waiting queue is full.
            ParamError: the request does not fit the context.
            RuntimeError: the engine thread has stopped.
        """
        if not self.alive:
            raise RuntimeError("the engine is not running")
        self.check_capacity()
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[request_id] = (loop, q)
        with self._lock:
            self._queued += 1
        self._inbox.put(("add", (request_id, prompt, params)))

        def close(finished: bool) -> None:
            self._streams.pop(request_id, None)
            if not finished:
                self._inbox.put(("abort", request_id))

        async with contextlib.aclosing(read_stream(q, close)) as stream:
            async for item in stream:
                yield item
