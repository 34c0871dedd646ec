"""The engine core: an :class:`~attnlab.serving.engine.Engine` alone in its own process.

vLLM runs its API server (HTTP, tokenisation, streaming) in one process and its engine
core in another, so the two never share a GIL. This module is the second process of
``attnlab serve``'s default layout; :class:`~attnlab.serving.engine_client.EngineProcess`
is the API process's side. The two talk over one Unix socket pair (a
``multiprocessing`` connection: pickled messages); the core is started as a fresh interpreter
running :func:`main` with its end of the pair, and first reads ``(factory, threads, cpus, parent pid)``:

* API -> core: ``("add", request_id, prompt_ids, params, grammar_source)``,
  ``("abort", request_id)``, ``("metrics", token)``, ``("stop",)``;
* core -> API: ``("ready", info)`` once the engine is built (or ``("failed", why)``),
  then per step ``("out", outputs, num_waiting, adds_handled)``, ``("error", request_id,
  kind, param, message)`` for a request the engine refused (it alone), ``("metrics",
  token, text)``, and ``("dead", why)`` if the engine loop itself fails.

The core reads every queued message between steps, steps back to back while there is
work and waits on the pipe (at most 0.5 s at a time) when there is none. It exits when
asked, when the pipe closes, or when its parent dies (``PR_SET_PDEATHSIG`` on Linux, and
the parent's pid is checked every wait), so no engine outlives its server.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["EngineFactory", "core_main", "engine_facts", "main", "metrics_text"]

log = logging.getLogger(__name__)

#: Builds the engine in the core process: returns an Engine, or ``(Engine, model name)``.
EngineFactory = Callable[[], Any]


def _die_with_parent(parent: int) -> None:
    """Ask Linux to SIGTERM this process when its parent exits (no orphan engine)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the call: go now
        os._exit(0)


def engine_facts(engine: Any, name: str | None) -> dict[str, Any]:
    """What the API side needs of an engine it does not hold (and ``attnlab serve``'s
    banner): the model name, tokenizer, context, pool and speculative settings."""
    pool = engine.pool
    spec = engine.speculative
    return {
        "name": name,
        "tokenizer": engine.tokenizer,
        "vocab_size": engine.vocab_size,
        "max_model_len": engine.max_model_len,
        "max_waiting": engine.max_waiting,
        "block_size": pool.block_size,
        "num_blocks": pool.num_blocks,
        "kv_dtype": pool.storage.kv_dtype or "float",
        "speculative": None if spec is None else (spec.method, spec.num_tokens),
        "pid": os.getpid(),
        "threads": _threads(),
        "cpus": sorted(os.sched_getaffinity(0)),
    }


def _threads() -> int:
    import torch

    return int(torch.get_num_threads())


def metrics_text(engine: Any) -> str:
    """The engine's ``/metrics`` text (Prometheus), its gauges read now."""
    from attnlab.serving.metrics import step_kinds_text

    a = engine.pool.allocator
    text = engine.metrics.prometheus(
        cache_hit_rate=a.hits / a.queries if a.queries else 0.0,
        blocks_free=engine.pool.num_free_blocks,
        live=engine.gauges(),
    )
    return str(text) + step_kinds_text(dict(engine.runner.step_kinds))


class _Core:
    """The core's loop state: the engine, the pipe, what the API has sent."""

    def __init__(self, engine: Any, conn: Any, parent: int) -> None:
        self.engine, self.conn, self.parent = engine, conn, parent
        self.stop = False
        self.handled = 0  # adds read since the last report

    def _add(self, rid: str, ids: list[int], params: Any, grammar: str | None) -> None:
        from attnlab.serving.params import ParamError

        self.handled += 1
        try:
            if grammar is not None:  # compiled here: a compiled grammar does not pickle
                from attnlab.generation.grammar import Grammar

                g = Grammar(grammar, self.engine.tokenizer, self.engine.vocab_size)
                params = dataclasses.replace(params, grammar=g)
            self.engine.add_request(rid, ids, params)
        except Exception as e:  # the request fails alone; the engine goes on
            kind = type(e).__name__
            param = e.param if isinstance(e, ParamError) else None
            self.conn.send(("error", rid, kind, param, str(e)))

    def read(self, timeout: float | None) -> None:
        """Handle every queued message, waiting up to ``timeout`` for the first."""
        if not self.conn.poll(timeout):
            return
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):  # the API process is gone
                self.stop = True
                return
            kind = msg[0]
            if kind == "add":
                self._add(*msg[1:])
            elif kind == "abort":
                self.engine.abort(msg[1])
            elif kind == "metrics":
                self.conn.send(("metrics", msg[1], metrics_text(self.engine)))
            elif kind == "stop":
                self.stop = True
                return
            if not self.conn.poll(0):
                return

    def run(self) -> None:
        eng = self.engine
        while not self.stop:
            if os.getppid() != self.parent:
                return
            self.read(0 if eng.has_work() else 0.5)
            if self.stop:
                return
            outs = eng.step() if eng.has_work() else []
            if outs or self.handled:
                self.conn.send(("out", outs, eng.num_waiting, self.handled))
                self.handled = 0


def core_main(
    conn: Any, factory: EngineFactory, threads: int | None, cpus: list[int] | None, parent: int
) -> None:
    """The core process's loop, from :func:`main`: build the engine, report, serve.

    Args:
        conn: this end of the pipe.
        factory: builds the engine (called here, so the model loads in this process).
        threads: torch intra-op threads of the engine, or None for torch's default.
        cpus: the CPUs this process runs on once its engine is built, or None (any).
        parent: the API process's pid.
    """
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the server, which stops us
    import torch

    if threads:
        torch.set_num_threads(threads)
    try:
        built = factory()
        engine, name = built if isinstance(built, tuple) else (built, None)
        if cpus is not None:  # after the build: compiling decode buckets uses every CPU
            os.sched_setaffinity(0, cpus)
        conn.send(("ready", engine_facts(engine, name)))
    except BaseException as e:  # the API process raises it (a user error stays one line)
        try:
            conn.send(("failed", e))
        except Exception:
            with contextlib.suppress(Exception):
                conn.send(("failed", RuntimeError(f"{type(e).__name__}: {e}")))
        return
    core = _Core(engine, conn, parent)
    try:
        core.run()
    except BaseException as e:  # a bug: say so, so every open stream fails instead of hanging
        log.exception("the engine core failed")
        with contextlib.suppress(Exception):
            conn.send(("dead", f"{type(e).__name__}: {e}"))
    finally:
        with contextlib.suppress(Exception):
            conn.close()


def main(argv: list[str]) -> None:
    """The core process's program: ``argv[1]`` is its end of the socket pair."""
    from multiprocessing.connection import Connection

    conn = Connection(int(argv[1]))
    factory, threads, cpus, parent = conn.recv()
    core_main(conn, factory, threads, cpus, parent)
