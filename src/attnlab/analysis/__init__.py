"""Analysis tools: a cost model, an advisor, diagnostics and attention statistics.

* :func:`estimate` (:mod:`attnlab.analysis.cost`): FLOPs and bytes per component of any
  config the library builds, by arithmetic; :func:`describe` turns a config into the
  :class:`ArchSpec` it reasons about.
* :func:`advise` (:mod:`attnlab.analysis.advisor`): attention settings for a task, with
  reasons in numbers.
* :func:`diagnose` (:mod:`attnlab.analysis.diagnostics`): the first module producing
  NaN/Inf, mask and shape checks, per-head statistics.
* :mod:`attnlab.analysis.attention_stats`: entropy and summaries of attention weights.

Names are imported on first use, so ``import attnlab.analysis`` stays cheap (the cost
model does not need torch).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "ArchSpec",
    "CostReport",
    "DiagnosisReport",
    "advise",
    "describe",
    "diagnose",
    "estimate",
]

_WHERE = {
    "ArchSpec": "attnlab.analysis.arch",
    "describe": "attnlab.analysis.arch",
    "estimate": "attnlab.analysis.cost",
    "CostReport": "attnlab.analysis.cost",
    "advise": "attnlab.analysis.advisor",
    "diagnose": "attnlab.analysis.diagnostics",
    "DiagnosisReport": "attnlab.analysis.diagnostics",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'attnlab.analysis' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
