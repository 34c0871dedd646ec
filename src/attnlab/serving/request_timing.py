"""Where a request's time to first token went, measured inside the server.

A client sees one number per request (its time to first token); the slowest of 64 decides a
p99. To explain it, the engine notes for each request (its first choice):

* ``queue_ms``: arrival in the engine to the first step that ran its prompt;
* ``prompt_ms``: the forward time of the steps that ran its prompt (``prompt_steps`` of
  them: a chunked prompt takes several), and ``step_ms``, those steps' whole time
  (schedule, forward, sampling, detokenising);
* ``kind``: which path ran those forwards: ``prompt-graph`` (the compiled prompt steps of
  :mod:`~attnlab.serving.step_buckets`), ``decode-graph`` (a decode bucket) or ``eager``;
* ``batch``: the most sequences in one of those steps;
* ``first_ms``: arrival in the engine to its first token;
* ``gc_ms``: the garbage collector's pauses in the engine process during those steps.

These travel with the request's last :class:`~attnlab.serving.outputs.RequestOutput`
(``timings``); the HTTP side adds its own (the request's arrival at the HTTP server, its
first byte out, its end) to the access-log line
(:class:`~attnlab.serving.access_log.AccessLog`). :class:`GcClock` sums the collector's
pauses of its process (``gc.callbacks``).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GcClock", "RequestTiming", "gc_clock"]


class GcClock:
    """The garbage collector's pauses in this process, summed (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self.longest = 0.0
        self._start: float | None = None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            pause = time.perf_counter() - self._start
            self._start = None
            self.seconds += pause
            self.longest = max(self.longest, pause)
            gen = int(info.get("generation", 0))
            if 0 <= gen < 3:
                self.collections[gen] += 1


_CLOCK: list[GcClock] = []


def gc_clock() -> GcClock:
    """This process's :class:`GcClock` (installed on first use)."""
    if not _CLOCK:
        _CLOCK.append(GcClock())
    return _CLOCK[0]


@dataclass
class RequestTiming:
    """What the engine measured of one request's way to its first token (engine clock:
    ``time.perf_counter``, which on Linux is the system's monotonic clock)."""

    admitted: float | None = None
    prompt_steps: int = 0
    prompt_seconds: float = 0.0
    step_seconds: float = 0.0
    gc_seconds: float = 0.0
    batch: int = 0
    kinds: list[str] = field(default_factory=list)

    def add_step(self, *, start: float, forward: float, step: float, gc: float, kind: str,
                 batch: int) -> None:  # fmt: skip
        """Note a step that ran (part of) the prompt."""
        if self.admitted is None:
            self.admitted = start
        self.prompt_steps += 1
        self.prompt_seconds += forward
        self.step_seconds += step
        self.gc_seconds += gc
        self.batch = max(self.batch, batch)
        if kind not in self.kinds:
            self.kinds.append(kind)

    def summary(self, arrival: float, first_token: float | None) -> dict[str, Any]:
        """The fields of the access-log line (milliseconds; ``arrival``: the engine's)."""
        out: dict[str, Any] = {"arrival": arrival}
        if self.admitted is not None:
            out["queue_ms"] = (self.admitted - arrival) * 1e3
            out["prompt_ms"] = self.prompt_seconds * 1e3
            out["step_ms"] = self.step_seconds * 1e3
            out["prompt_steps"] = self.prompt_steps
            out["kind"] = "+".join(self.kinds)
            out["batch"] = self.batch
            out["gc_ms"] = self.gc_seconds * 1e3
        if first_token is not None:
            out["first_ms"] = (first_token - arrival) * 1e3
        return out
