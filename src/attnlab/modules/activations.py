"""Activation functions by name, as configs spell them."""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor


def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,  # exact (erf) GELU, Hendrycks & Gimpel 2016; BERT's "gelu"
    "gelu_new": _gelu_tanh,  # tanh approximation (GPT-2's "gelu_new")
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_tanh": _gelu_tanh,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def get_activation(name: str) -> Callable[[Tensor], Tensor]:
    """Return the activation called ``name``; raise ``ValueError`` listing the known ones."""
    try:
        return _ACTIVATIONS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown activation {name!r}; known: {sorted(_ACTIVATIONS)}") from None


def activation_names() -> list[str]:
    """Names accepted by :func:`get_activation`."""
    return sorted(_ACTIVATIONS)
