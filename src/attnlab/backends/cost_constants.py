"""Measured constants of the cost model (:mod:`attnlab.backends.cost_model`).

For each device type and backend: ``(overhead_s, seconds_per_unit)`` for the
forward pass (``"fwd"``) and for forward + backward (``"fwd_bwd"``); one unit is
one (query, key) pair of one head at head dim 64. ``"weights"`` is the cost of
recomputing the weights when ``return_weights=True``.

Measured with::

    PYTHONPATH=src python benchmarks/attention.py --calibrate

on the project's machine (2 cores, AVX-512, torch 2.13 CPU, float32, B=1, 12 heads,
head dim 64, lengths 1024 and 2048, causal and sliding-window masks), which prints
this table. The machine was shared with other jobs (load average 4 on 2 cores)
while this was measured, and a Python loop of small kernels (``tiled``) slowed
down by up to 7x under that contention, so the table below keeps the *best* of
three in-process runs per cell (2048 to 16384) rather than the fit of one
contended run; the benchmark (``docs/benchmarks.md``) checks the choices it leads to.
"""

from __future__ import annotations

Pair = tuple[float, float]

CONSTANTS: dict[str, dict[str, dict[str, Pair]]] = {
    "cpu": {
        "reference": {"fwd": (2e-4, 7.5e-9), "fwd_bwd": (1e-3, 2.8e-8)},
        "sdpa": {"fwd": (1e-4, 1.6e-9), "fwd_bwd": (5e-4, 5.5e-9)},
        "tiled": {"fwd": (1e-3, 2.2e-9), "fwd_bwd": (3e-3, 7.5e-9)},
        "sparse": {"fwd": (2e-3, 1.8e-8), "fwd_bwd": (5e-3, 3.2e-8)},
        "flex": {"fwd": (5e-4, 3.0e-9), "fwd_bwd": (1e-3, 9.0e-9)},
        "weights": {"fwd": (0.0, 3.0e-9), "fwd_bwd": (0.0, 3.0e-9)},
    },
}
