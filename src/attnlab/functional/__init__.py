"""Pure tensor functions: the reference attention math, masks, positions and sampling.

This is the lowest layer: it imports no other part of attnlab. The public attention call,
``scaled_dot_product_attention``, chooses a backend, so it lives above the backends
(:mod:`attnlab.backends.api`) and is named at the package root,
``attnlab.scaled_dot_product_attention``; :func:`sdpa_reference` here is the plain
reference math every backend is checked against.
"""

from typing import NoReturn

from attnlab.functional import masks, positions, sampling
from attnlab.functional.attention import safe_softmax, sdpa_reference

__all__ = [
    "masks",
    "positions",
    "safe_softmax",
    "sampling",
    "sdpa_reference",
]

_MOVED = {
    "scaled_dot_product_attention": (
        "attnlab.functional.scaled_dot_product_attention moved to "
        "attnlab.scaled_dot_product_attention (also attnlab.backends."
        "scaled_dot_product_attention): it chooses a backend, so it lives above the "
        "backends layer, and this package is the layer below them"
    ),
}


def __getattr__(name: str) -> NoReturn:
    # the old place of a moved name says where it went (nothing is imported)
    if name in _MOVED:
        raise AttributeError(_MOVED[name])
    raise AttributeError(f"module 'attnlab.functional' has no attribute {name!r}")
