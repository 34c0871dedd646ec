"""Pure tensor functions: the reference attention math, masks, positions and sampling."""

from attnlab.functional import masks, positions, sampling
from attnlab.functional.attention import (
    safe_softmax,
    scaled_dot_product_attention,
    sdpa_reference,
)

__all__ = [
    "masks",
    "positions",
    "safe_softmax",
    "sampling",
    "scaled_dot_product_attention",
    "sdpa_reference",
]
