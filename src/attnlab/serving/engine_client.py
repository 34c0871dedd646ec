"""The API process's side of the engine core (:mod:`attnlab.serving.engine_core`).

:class:`EngineProcess` spawns the core, waits for its engine, and then offers the
HTTP handlers what :class:`~attnlab.serving.async_engine.AsyncEngine` offers (``generate``,
``check_capacity``, ``validate``, ``alive``, ``metrics_text``, the tokenizer and the
context), so the handlers run unchanged over either layout. The pipe is read by the
asyncio event loop itself (``loop.add_reader``), so outputs reach their streams without a
thread hop, and requests are written to it from the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

from attnlab.serving.engine_core import EngineFactory
from attnlab.serving.lifecycle import QueueFull
from attnlab.serving.outputs import RequestOutput, read_stream
from attnlab.serving.params import ParamError, SamplingParams
from attnlab.serving.validation import validate_request

__all__ = ["EngineProcess"]

#: The core process's program (``-c``: ``-m attnlab.serving.engine_core`` would import the
#: module twice, as ``attnlab.serving`` imports it).
_CORE = "import sys; from attnlab.serving.engine_core import main; main(sys.argv)"

log = logging.getLogger(__name__)


def _error(kind: str, param: str | None, message: str) -> Exception:
    """The core's refusal of a request as the exception the engine raised."""
    if kind == "ParamError":
        return ParamError(param or "prompt", message)
    if kind == "QueueFull":
        return QueueFull(message)
    return RuntimeError(f"{kind}: {message}")


class EngineProcess:
    """An engine in its own process, driven from an asyncio event loop.

    Args:
        factory: a picklable callable that builds the engine in the core process (an
            Engine, or ``(Engine, model name)``), e.g. ``functools.partial(load_engine,
            folder, num_blocks=...)``.
        threads: the core's torch intra-op threads (None: torch's default).
        cpus: pin the core to these CPUs and this process to the others (when some are
            left), or None to leave both to the OS scheduler.
        start_timeout: seconds to wait for the core's engine (its first start compiles
            the model's steps: minutes on a slow or busy machine).

    Attributes:
        info: what the core reported once ready (``name``, ``vocab_size``,
            ``max_model_len``, ``block_size``, ``num_blocks``, ``kv_dtype``,
            ``speculative``, ``pid``, ``threads``).
    """

    def __init__(
        self,
        factory: EngineFactory,
        *,
        threads: int | None = None,
        cpus: list[int] | None = None,
        start_timeout: float = 1800.0,
    ) -> None:
        # a fresh interpreter, not multiprocessing's spawn, which re-runs the caller's
        # ``__main__`` module (a script without a main guard would start a second server)
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.process = subprocess.Popen(
            [sys.executable, "-c", _CORE, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            env=env,
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send((factory, threads, cpus, os.getpid()))
        self.info = self._wait_ready(start_timeout)
        # pinned once the engine is built (its decode buckets compile on every CPU)
        if cpus is not None and os.sched_getaffinity(0) - set(cpus):
            os.sched_setaffinity(0, os.sched_getaffinity(0) - set(cpus))
        self.tokenizer = self.info.pop("tokenizer")
        self.vocab_size: int = self.info["vocab_size"]
        self.max_model_len: int = self.info["max_model_len"]
        self.max_waiting: int = self.info["max_waiting"]
        self._streams: dict[str, asyncio.Queue[Any]] = {}
        self._metrics: dict[int, asyncio.Future[str]] = {}
        self._tokens = 0
        self._queued = 0  # adds sent, not yet read by the core
        self._waiting = 0  # the core's queue at its last report
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: str | None = None

    def _wait_ready(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.2):
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the engine process exited (status {self.process.returncode}) before "
                    "its engine was built"
                )
            if time.monotonic() > deadline:
                self.process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(30)  # a large process under load can take a while
                raise RuntimeError(
                    f"the engine process was not ready after {timeout:.0f} s (the first start "
                    "of a model compiles its steps; --decode-buckets off starts without "
                    "compiling)"
                )
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self._reap()
            raise RuntimeError(
                f"the engine process exited (status {self.process.returncode}) before "
                "its engine was built"
            ) from None
        if kind != "ready":
            self._reap()
            if isinstance(payload, BaseException):
                raise payload  # the engine's own error (a missing file, a bad setting)
            raise RuntimeError(f"the engine process could not build the engine: {payload}")
        return dict(payload)

    def _reap(self, timeout: float = 10.0) -> None:
        """Wait for the core to exit; kill it if it has not within ``timeout``."""
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(30)  # SIGKILLed: it goes, however long the teardown

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start reading the core's messages on the running event loop (idempotent)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._conn.fileno(), self._on_readable)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core after its current step, and wait for it (killed if it hangs)."""
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._conn.fileno())
            self._loop = None
        with contextlib.suppress(OSError, ValueError):
            self._conn.send(("stop",))
        self._reap(timeout)
        with contextlib.suppress(OSError):
            self._conn.close()

    @property
    def alive(self) -> bool:
        return self.process.poll() is None and self.error is None

    # ------------------------------------------------------------------ the pipe

    def _on_readable(self) -> None:
        try:
            while self._conn.poll(0):
                self._handle(self._conn.recv())
        except (EOFError, OSError) as e:
            assert self._loop is not None
            self._loop.remove_reader(self._conn.fileno())
            self._fail_all(f"the engine process exited ({type(e).__name__})")

    def _handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "out":
            _, outs, waiting, handled = msg
            self._queued -= handled
            self._waiting = waiting
            for out in outs:
                q = self._streams.get(out.request_id)
                if q is not None:
                    q.put_nowait(out)
        elif kind == "error":
            _, rid, err_kind, param, message = msg
            q = self._streams.get(rid)
            if q is not None:
                q.put_nowait(_error(err_kind, param, message))
        elif kind == "metrics":
            fut = self._metrics.pop(msg[1], None)
            if fut is not None and not fut.done():
                fut.set_result(msg[2])
        elif kind == "dead":
            self._fail_all(f"the engine failed: {msg[1]}")

    def _fail_all(self, why: str) -> None:
        self.error = why
        log.error("%s", why)
        for q in self._streams.values():
            q.put_nowait(RuntimeError(why))
        for fut in self._metrics.values():
            if not fut.done():
                fut.set_exception(RuntimeError(why))
        self._metrics.clear()

    def _send(self, msg: tuple[Any, ...]) -> None:
        try:
            self._conn.send(msg)
        except (OSError, ValueError) as e:
            raise RuntimeError(f"the engine process is gone ({type(e).__name__})") from None

    # ------------------------------------------------------------------ the handlers' API

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Check a request against the context; raise :class:`ParamError` naming the field."""
        validate_request(
            prompt_ids,
            params,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            block_size=self.info["block_size"],
            num_blocks=self.info["num_blocks"],
        )

    def check_capacity(self) -> None:
        """Raise :class:`QueueFull` when no more requests can be queued."""
        if self._waiting + self._queued >= self.max_waiting:
            raise QueueFull(
                f"{self._waiting + self._queued} requests are waiting "
                f"(max_waiting={self.max_waiting})"
            )

    async def metrics_text(self) -> str:
        """``/metrics`` as the core renders it now (after its current step)."""
        if not self.alive:
            raise RuntimeError("the engine is not running")
        self._tokens += 1
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._metrics[self._tokens] = fut
        self._send(("metrics", self._tokens))
        return await asyncio.wait_for(fut, 30.0)

    async def generate(
        self, request_id: str, prompt: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs until it finishes (as
        :meth:`AsyncEngine.generate <attnlab.serving.async_engine.AsyncEngine.generate>`)."""
        if not self.alive:
            raise RuntimeError("the engine is not running")
        self.check_capacity()
        grammar = params.grammar
        source = None
        if grammar is not None:
            source = grammar.source
            params = _without_grammar(params)
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[request_id] = q
        self._queued += 1
        self._send(("add", request_id, list(prompt), params, source))

        def close(finished: bool) -> None:
            self._streams.pop(request_id, None)
            if not finished and self.alive:
                with contextlib.suppress(RuntimeError):
                    self._send(("abort", request_id))

        async with contextlib.aclosing(read_stream(q, close)) as stream:
            async for item in stream:
                yield item


def _without_grammar(params: SamplingParams) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, grammar=None)
