"""Attention backends behind one signature and one registry.

Choose one by name (``scaled_dot_product_attention(..., backend="sdpa")``), for a
block of code (``with attnlab.backends.use("reference"): ...``), or let ``auto``
pick; :func:`explain` says why.

The package by role: :mod:`.call` (the records), :mod:`.registry` (names, ``use()``, the
memo store), :mod:`.select` (``auto``'s choice and ``explain``), :mod:`.dispatch`
(running a call or a plan), :mod:`.plan` (the per-forward attention plan), :mod:`.api`
(the public ``scaled_dot_product_attention``), and one module per backend.
"""

from attnlab.backends import flex as _flex  # noqa: F401  (registers)
from attnlab.backends import linear as _linear  # noqa: F401  (registers)
from attnlab.backends import paged as _paged  # noqa: F401  (registers)
from attnlab.backends import paged_kernel as _paged_kernel  # noqa: F401  (registers)
from attnlab.backends import reference as _reference  # noqa: F401  (registers)
from attnlab.backends import sdpa as _sdpa  # noqa: F401  (registers)
from attnlab.backends import sparse as _sparse  # noqa: F401  (registers)
from attnlab.backends import tiled as _tiled  # noqa: F401  (registers)
from attnlab.backends.api import scaled_dot_product_attention
from attnlab.backends.call import AttentionCall, Backend, Explanation
from attnlab.backends.dispatch import attend, dispatch, dispatch_trusted
from attnlab.backends.plan import AttentionPlan, BlockTable, KVView, SequenceLayout, make_plan
from attnlab.backends.registry import available, current, forget_choices, get, register, use
from attnlab.backends.select import choose, choose_call, explain
from attnlab.backends.weights import attention_weights

__all__ = [
    "AttentionCall",
    "AttentionPlan",
    "Backend",
    "BlockTable",
    "Explanation",
    "KVView",
    "SequenceLayout",
    "attend",
    "attention_weights",
    "available",
    "choose",
    "choose_call",
    "current",
    "dispatch",
    "dispatch_trusted",
    "explain",
    "forget_choices",
    "get",
    "make_plan",
    "register",
    "scaled_dot_product_attention",
    "use",
]
