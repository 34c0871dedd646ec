"""A file of measured float-GEMM choices, so that every start of a server multiplies alike.

:func:`~attnlab.backends.linear_pack.choose_gemm` times the float kernels of a decode
step's linears once per (shape, bias, dtype, row bucket, threads). Two starts of the
same server on a quiet machine measured different kernels for a third of the 4-layer
Llama's (shape, rows) pairs: their times differ by less than the machine's noise, so the
pick is noise, and a different pick is a different compiled step (another inductor graph,
other timings). Inside :func:`persisted_choices` (``attnlab serve`` and ``attnlab
generate`` run in it), a choice is read from a small JSON file instead of measured again,
and a measured one is written to it, so the first start on a machine decides and later
starts reuse that decision.

The file (default ``~/.cache/attnlab/gemm_choices.json``, next to the built kernels;
``ATTNLAB_GEMM_CACHE`` names another, ``off`` turns it off) holds one table per machine
key (torch's version, a hash of the CPU's flags and model name, the thread count); a
table maps ``"N,K,bias,dtype,rows"`` to the decision and its timings. It is written
atomically (a temporary file in the same folder, renamed over the old one), merged with
what other processes wrote meanwhile. A file that cannot be read or parsed, or an entry
naming a kernel that cannot run here, is ignored with a warning and rewritten.
``ATTNLAB_GEMM_REMEASURE=1`` (``attnlab serve --remeasure-gemm``) measures every choice
again and rewrites it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ENV_PATH",
    "ENV_REMEASURE",
    "ChoiceFile",
    "active_choice_file",
    "default_path",
    "machine_key",
    "persisted_choices",
]

log = logging.getLogger(__name__)

#: the environment variable naming the file (or ``off``)
ENV_PATH = "ATTNLAB_GEMM_CACHE"
#: the environment variable that makes every choice be measured again (``1``)
ENV_REMEASURE = "ATTNLAB_GEMM_REMEASURE"
_VERSION = 1


def default_path() -> Path | None:
    """The file :func:`persisted_choices` uses by default, or None (``ATTNLAB_GEMM_CACHE=off``)."""
    env = os.environ.get(ENV_PATH)
    if env:
        return None if env.strip().lower() == "off" else Path(env)
    from attnlab.backends.native import kernel_dir

    return kernel_dir().parent / "gemm_choices.json"


def _cpu_identity() -> str:
    """The CPU's model name and flags (Linux ``/proc/cpuinfo``), else the platform's words."""
    name, flags = "", ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not name:
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].strip()
    return f"{name}|{flags}" if name or flags else f"{platform.machine()}|{platform.processor()}"


def machine_key(threads: int) -> str:
    """What a choice depends on beyond the shape: torch, the CPU, the thread count."""
    cpu = hashlib.sha1(_cpu_identity().encode()).hexdigest()[:16]
    return f"torch {torch.__version__}; cpu {cpu}; {threads} threads"


class ChoiceFile:
    """The JSON file of choices: read once, written (merged, atomically) per new choice.

    Args:
        path: the file.
        remeasure: ignore what the file holds (every choice is measured and rewritten).
    """

    def __init__(self, path: Path, *, remeasure: bool = False) -> None:
        self.path = Path(path)
        self.remeasure = remeasure
        self._tables: dict[str, dict[str, dict[str, Any]]] | None = None
        self.hits = 0
        self.writes = 0

    def _read(self, *, warn: bool) -> dict[str, dict[str, dict[str, Any]]]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        except OSError as e:
            if warn:
                log.warning("%s cannot be read (%s): ignored, it will be rewritten", self.path, e)
            return {}
        try:
            data = json.loads(text)
            tables = data["machines"]
            if data.get("version") != _VERSION or not isinstance(tables, dict):
                raise ValueError(f"version {data.get('version')!r}, expected {_VERSION}")
            return {
                str(m): {str(k): dict(v) for k, v in t.items() if isinstance(v, dict)}
                for m, t in tables.items()
                if isinstance(t, dict)
            }
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            if warn:
                log.warning(
                    "%s is not a GEMM choice file (%s: %s): ignored, it will be rewritten",
                    self.path, type(e).__name__, e,
                )  # fmt: skip
            return {}

    @property
    def tables(self) -> dict[str, dict[str, dict[str, Any]]]:
        if self._tables is None:
            self._tables = {} if self.remeasure else self._read(warn=True)
        return self._tables

    def get(
        self, machine: str, key: str, runnable: Sequence[str]
    ) -> tuple[str, str, dict[str, float]] | None:
        """``(chosen, other_rows, timings_us)`` stored for ``key`` on ``machine``, or None
        (measure it). An entry naming a kernel not in ``runnable`` (or ``"mkl"`` for
        other rows), or malformed, is dropped with a warning (measured and rewritten)."""
        entry = self.tables.get(machine, {}).get(key)
        if entry is None:
            return None
        chosen, other, timings = (
            entry.get("chosen"),
            entry.get("other_rows"),
            entry.get("timings_us"),
        )
        if (
            chosen in runnable
            and other in runnable
            and other != "mkl"
            and isinstance(timings, dict)
            and all(isinstance(v, int | float) for v in timings.values())
        ):
            self.hits += 1
            return str(chosen), str(other), {str(k): float(v) for k, v in timings.items()}
        log.warning("%s: entry %s (%r) cannot be used here: measured again", self.path, key, entry)
        self.tables[machine].pop(key, None)
        return None

    def put(self, machine: str, key: str, entry: dict[str, Any]) -> None:
        """Store ``entry`` and write the file: what is on disk now (other processes'
        choices) plus this process's, through a temporary file renamed over it."""
        self.tables.setdefault(machine, {})[key] = entry
        merged = self._read(warn=False)
        for m, table in self.tables.items():
            merged.setdefault(m, {}).update(table)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(
                        {"version": _VERSION, "machines": merged}, f, indent=1, sort_keys=True
                    )
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as e:  # a read-only home: the choice still holds in this process
            log.warning(
                "%s cannot be written (%s): the choice is kept in memory only", self.path, e
            )
            return
        self.writes += 1


_ACTIVE: list[ChoiceFile] = []


def active_choice_file() -> ChoiceFile | None:
    """The file of the innermost :func:`persisted_choices` block, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def persisted_choices(
    path: Path | str | None = None, *, remeasure: bool | None = None
) -> Iterator[ChoiceFile | None]:
    """Inside the block, float-GEMM choices are read from and written to a file.

    Args:
        path: the file (default :func:`default_path`: ``ATTNLAB_GEMM_CACHE`` or
            ``~/.cache/attnlab/gemm_choices.json``; ``off`` there: no file).
        remeasure: measure every choice again and rewrite it (default: whether
            ``ATTNLAB_GEMM_REMEASURE`` is ``1``).

    Yields:
        The :class:`ChoiceFile` (its ``hits``/``writes`` count the reuses and new
        choices), or None when the file is off.
    """
    where = Path(path) if path is not None else default_path()
    if remeasure is None:
        remeasure = os.environ.get(ENV_REMEASURE, "").strip() not in ("", "0")
    if where is None:
        yield None
        return
    f = ChoiceFile(where, remeasure=remeasure)
    _ACTIVE.append(f)
    try:
        yield f
    finally:
        _ACTIVE.remove(f)
