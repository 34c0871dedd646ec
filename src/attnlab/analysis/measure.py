"""Measure what the cost model predicts: matmul FLOPs and peak tensor memory of a call.

* :func:`count_matmul_flops` runs a function under
  ``torch.utils.flop_counter.FlopCounterMode`` (which counts matmuls only, and 0 for
  torch's fused attention kernels: pin ``attnlab.backends.use("reference")`` to count
  the attention math).
* :func:`peak_memory` runs a function under ``torch.profiler`` with memory profiling and
  returns the peak of the bytes allocated by tensors during the call, above what was
  allocated when it started. The process's resident size is no measure of this: glibc
  keeps freed buffers. Run it in a fresh process for a clean baseline (a process that
  already ran other work can show allocator state left over from it).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["count_matmul_flops", "peak_memory"]


def count_matmul_flops(fn: Callable[[], Any]) -> int:
    """FLOPs of the matmuls ``fn()`` runs, as ``FlopCounterMode`` counts them."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def peak_memory(fn: Callable[[], Any]) -> int:
    """Peak CPU tensor bytes allocated during ``fn()`` above the level at its start.

    Reads the profiler's memory events (their running "Total Allocated").
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    totals = [
        e["args"]["Total Allocated"]
        for e in events
        if e.get("name") == "[memory]" and "Total Allocated" in e.get("args", {})
    ]
    return int(max(totals, default=0))
