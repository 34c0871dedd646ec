"""Measured constants of the cost model (:mod:`attnlab.backends.cost_model`).

For each device type and backend: ``(overhead_s, seconds_per_unit)`` for the
forward pass (``"fwd"``) and for forward + backward (``"fwd_bwd"``); one unit is
one (query, key) pair of one head at head dim 64. ``"sdpa_flash"`` is torch's
kernel without a mask or with ``is_causal`` only (its flash path), ``"sdpa"`` the
same kernel reading a dense mask. ``"weights"`` is the cost of recomputing the
weights when ``return_weights=True``.

Measured with::

    ATTNLAB_BENCH_THREADS=1 PYTHONPATH=src python benchmarks/attention.py --calibrate

on the project's machine (2 cores, AVX-512, torch 2.13 CPU, float32, B=1, 12 heads,
head dim 64; forward at 2048 and 8192, forward + backward at 1024 and 2048; causal and
sliding-window w=512), which prints a fitted table. The machine was shared with other
jobs (load average 3-8 on 2 cores): with two threads, every multi-threaded kernel call
waited for a descheduled thread and a loop of small kernels (``tiled``) slowed down
up to 30x, so the calibration ran on one thread, every backend of a cell back to back,
best of two. The fit's intercepts (tens of ms from two noisy points) were replaced by
small per-call overheads, and ``reference``'s forward (two points of equal size) by its
per-unit cost at 2048; ``sdpa`` was split into its flash and masked paths, whose
per-unit costs differ. Estimates are therefore one-thread times: what matters to
``auto`` is their ranking, which the benchmark checks cell by cell.

``"sparse_band"`` is the sparse backend's banded path (:mod:`attnlab.backends.banded`:
a band of key blocks read in place, plus a few single keys), whose units count the pairs
it computes (``L * (|D| * b + X)``, weighted by the block's relative time per pair,
``BAND_BLOCKS``). It was added later, on a more loaded machine, so it is scaled from
``tiled``'s constants by the per-unit ratio measured in the same run (one thread,
process time, sliding window 512, best of three; the cells of ``--calibrate``, which
now fits a ``sparse_band`` row of its own): 1.26x and 1.32x ``tiled``'s per-unit time
forward at 8192 and 2048 tokens (6.5e-9 taken; the two take the same time there, the
band computing fewer pairs), 2.3x and 2.6x forward + backward at 1024 and 2048 (autograd
through the per-offset products; 3.9e-8 taken). So a plain window stays with ``tiled``,
while Longformer's window + global keys, whose global columns cost ``tiled`` up to three
more 256-wide tiles per row, goes to the band (2.4x faster than ``tiled`` at 4096 tokens).
"""

from __future__ import annotations

Pair = tuple[float, float]

CONSTANTS: dict[str, dict[str, dict[str, Pair]]] = {
    "cpu": {
        "reference": {"fwd": (2e-4, 3.0e-8), "fwd_bwd": (1e-3, 6.9e-8)},
        "sdpa_flash": {"fwd": (1e-4, 4.1e-9), "fwd_bwd": (1e-3, 1.2e-8)},
        "sdpa": {"fwd": (1e-4, 3.5e-9), "fwd_bwd": (5e-4, 2.1e-8)},
        "tiled": {"fwd": (2e-3, 5.0e-9), "fwd_bwd": (5e-3, 1.6e-8)},
        "sparse": {"fwd": (5e-3, 1.1e-8), "fwd_bwd": (5e-3, 5.9e-8)},
        "sparse_band": {"fwd": (2e-3, 6.5e-9), "fwd_bwd": (5e-3, 3.9e-8)},
        "flex": {"fwd": (1e-3, 2.8e-9), "fwd_bwd": (1e-3, 8.3e-9)},
        "weights": {"fwd": (0.0, 6.0e-9), "fwd_bwd": (0.0, 6.0e-9)},
    },
}
