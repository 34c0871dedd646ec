"""Attention backends behind one signature and one registry.

Choose one by name (``scaled_dot_product_attention(..., backend="sdpa")``), for a
block of code (``with attnlab.backends.use("reference"): ...``), or let ``auto``
pick; :func:`explain` says why.
"""

from attnlab.backends import flex as _flex  # noqa: F401  (registers)
from attnlab.backends import linear as _linear  # noqa: F401  (registers)
from attnlab.backends import paged as _paged  # noqa: F401  (registers)
from attnlab.backends import reference as _reference  # noqa: F401  (registers)
from attnlab.backends import sdpa as _sdpa  # noqa: F401  (registers)
from attnlab.backends import sparse as _sparse  # noqa: F401  (registers)
from attnlab.backends import tiled as _tiled  # noqa: F401  (registers)
from attnlab.backends.registry import (
    AttentionCall,
    Backend,
    Explanation,
    available,
    current,
    dispatch,
    dispatch_trusted,
    explain,
    get,
    register,
    use,
)
from attnlab.backends.weights import attention_weights

__all__ = [
    "AttentionCall",
    "Backend",
    "Explanation",
    "attention_weights",
    "available",
    "current",
    "dispatch",
    "dispatch_trusted",
    "explain",
    "get",
    "register",
    "use",
]
