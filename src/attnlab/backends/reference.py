"""The ``reference`` backend: the math in :mod:`attnlab.functional`, runs every call."""

from __future__ import annotations

from attnlab.backends.cost_model import Estimate, estimate
from attnlab.backends.registry import AttentionCall, Backend, register
from attnlab.functional.attention import sdpa_reference


def _check(call: AttentionCall) -> str | None:
    return None


def _cost(call: AttentionCall) -> Estimate | None:
    return estimate("reference", call, call.query_shape[-2] * call.key_shape[-2])


REFERENCE = register(
    Backend(
        name="reference",
        fn=sdpa_reference,
        check=_check,
        priority=1000,
        description="the full score matrix in float32/float64; runs every call and returns weights",
        cost=_cost,
    )
)
