"""Pure tensor functions: the reference attention math, masks, positions and sampling.

This is the lowest layer: none of its code depends on another part of attnlab. The public
attention call, ``scaled_dot_product_attention``, chooses a backend, so it is defined
above the backends (:mod:`attnlab.backends.api`) and named at the package root,
``attnlab.scaled_dot_product_attention``. DESIGN.md's public contract promises it here
too, as ``attnlab.functional.scaled_dot_product_attention``: this package forwards that
one name on first access (PEP 562), so importing it loads none of the backends.
:func:`sdpa_reference` here is the plain reference math every backend is checked against.
"""

from typing import Any

from attnlab.functional import masks, positions, sampling
from attnlab.functional.attention import safe_softmax, sdpa_reference

__all__ = [
    "masks",
    "positions",
    "safe_softmax",
    "sampling",
    "scaled_dot_product_attention",
    "sdpa_reference",
]


def __getattr__(name: str) -> Any:
    # the promised name, forwarded on first access to the function above the backends
    if name == "scaled_dot_product_attention":
        from attnlab.backends.api import scaled_dot_product_attention

        globals()[name] = scaled_dot_product_attention
        return scaled_dot_product_attention
    raise AttributeError(f"module 'attnlab.functional' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), "scaled_dot_product_attention"])
