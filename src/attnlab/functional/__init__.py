"""Pure tensor functions: the reference attention math and masks."""

from attnlab.functional import masks
from attnlab.functional.attention import (
    safe_softmax,
    scaled_dot_product_attention,
    sdpa_reference,
)

__all__ = ["masks", "safe_softmax", "scaled_dot_product_attention", "sdpa_reference"]
