"""Pure tensor functions: the reference attention math, masks, positions and sampling.

``scaled_dot_product_attention`` is the public attention call. It chooses a backend, so
it lives above them (:mod:`attnlab.backends.api`); this package names it for users
(DESIGN.md's contract) without importing it: the name is looked up on first use, and no
module of this layer imports a higher one.
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
    if name == "scaled_dot_product_attention":
        from attnlab.backends.api import scaled_dot_product_attention

        return scaled_dot_product_attention
    raise AttributeError(f"module 'attnlab.functional' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
