"""Helpers shared by the benchmark scripts: interleaved timing and writing docs/benchmarks.md."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def time_interleaved(
    fns: dict[str, Callable[[], object]],
    *,
    rounds: int,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Time each function ``rounds`` times, alternating between them, after ``warmup`` calls each.

    Alternating spreads the machine's noise over every candidate instead of one. With
    ``clock=time.process_time`` and one thread, other processes' load barely matters.
    Returns seconds per call for each name.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = clock()
            fn()
            times[name].append(clock() - t0)
    return times


def median_ms(xs: list[float]) -> float:
    return 1000 * statistics.median(xs)


def machine_line() -> str:
    return (
        f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"Python {platform.python_version()}"
    )


def write_section(heading: str, body: str, path: Path = DOCS) -> None:
    """Replace the text under ``heading`` (up to the next ``## `` heading) in docs/benchmarks.md."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    lines = text.splitlines()
    try:
        start = lines.index(heading)
    except ValueError:
        lines += ["", heading]
        start = len(lines) - 1
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    new = [*lines[: start + 1], "", *body.strip("\n").splitlines(), "", *lines[end:]]
    path.write_text("\n".join(new).rstrip("\n") + "\n")
