"""Reproductions of published results, small enough for a laptop CPU.

``attnlab experiment NAME [--quick] [--out DIR]`` runs one; each trains small models with
:class:`attnlab.train.Trainer`, writes a table (markdown and JSON), a plot, and the
published result beside ours. ``docs/experiments.md`` records the runs.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

# No torch at import: `attnlab --help` and `attnlab estimate` list this module's names.
__all__ = ["EXPERIMENTS", "describe", "run_experiment"]

#: Experiment name -> module (each defines NAME, TITLE, PAPER, PUBLISHED and ``run``).
EXPERIMENTS: dict[str, str] = {
    "extrapolation": "attnlab.experiments.extrapolation",
    "recall": "attnlab.experiments.recall",
    "selective-copy": "attnlab.experiments.selective_copy",
    "gqa": "attnlab.experiments.gqa",
    "induction": "attnlab.experiments.induction",
    "sinks": "attnlab.experiments.sinks",
    "induction-real": "attnlab.experiments.induction_real",
    "context": "attnlab.experiments.context",
    "kv-quant": "attnlab.experiments.kv_quant",
}


def _module(name: str) -> object:
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; known: {sorted(EXPERIMENTS)}")
    return importlib.import_module(EXPERIMENTS[name])


def describe(name: str) -> tuple[str, str]:
    """``(title, paper)`` of an experiment."""
    m = _module(name)
    return m.TITLE, m.PAPER  # type: ignore[attr-defined]


def run_experiment(
    name: str,
    *,
    quick: bool = False,
    out: str | Path | None = None,
    seed: int = 0,
    progress: bool = True,
    smoke: bool = False,
) -> Any:
    """Run experiment ``name`` and write its files under ``out`` (default ``runs/NAME``).

    Args:
        name: one of :data:`EXPERIMENTS`.
        quick: the short run (about two minutes on two cores).
        out: output folder.
        seed: the seed of data and weights.
        progress: progress bars on stderr.
        smoke: a few steps only, to check the pipeline (results mean nothing).
    """
    from attnlab._validate import check_seed
    from attnlab.experiments._common import write_result

    check_seed("seed", seed)
    m = _module(name)
    folder = Path(out) if out is not None else Path("runs") / name
    result = m.run(  # type: ignore[attr-defined]
        quick=quick, smoke=smoke, out=folder, seed=seed, progress=progress
    )
    write_result(result, folder)
    return result
