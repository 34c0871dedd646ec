"""Measured constants of the cost model (:mod:`attnlab.backends.cost_model`).

For each device type and backend: ``(overhead_s, seconds_per_unit)`` for the
forward pass (``"fwd"``) and for forward + backward (``"fwd_bwd"``); one unit is
one (query, key) pair of one head at head dim 64. ``"weights"`` is the cost of
recomputing the weights when ``return_weights=True``.

Measured with::

    PYTHONPATH=src python benchmarks/attention.py --calibrate

on the project's machine (2 cores, AVX-512, torch 2.13 CPU, float32, B=1, 12 heads,
head dim 64, lengths 1024 and 4096, causal and sliding-window masks), which prints
this table. The machine is shared, so the figures carry 10-30 % noise.
"""

from __future__ import annotations

Pair = tuple[float, float]

CONSTANTS: dict[str, dict[str, dict[str, Pair]]] = {
    "cpu": {
        "reference": {"fwd": (2e-4, 7.5e-9), "fwd_bwd": (5e-4, 2.2e-8)},
        "sdpa": {"fwd": (1e-4, 1.8e-9), "fwd_bwd": (3e-4, 6.0e-9)},
        "tiled": {"fwd": (1e-3, 2.5e-9), "fwd_bwd": (3e-3, 9.0e-9)},
        "sparse": {"fwd": (2e-3, 1.2e-8), "fwd_bwd": (5e-3, 3.5e-8)},
        "flex": {"fwd": (5e-4, 2.5e-9), "fwd_bwd": (1e-3, 8.0e-9)},
        "weights": {"fwd": (0.0, 3.0e-9), "fwd_bwd": (0.0, 3.0e-9)},
    },
}
