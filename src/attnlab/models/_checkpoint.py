"""Per-layer activation checkpointing, switched on by a config's ``gradient_checkpointing``.

A checkpointed layer keeps only its input for the backward and runs its forward again
when the gradient reaches it (Chen et al., 2016, "Training deep nets with sublinear
memory cost"): the activations kept for the backward shrink from every layer's
intermediates to one ``[B, L, D]`` tensor per layer, for one more forward's work.
PyTorch's non-reentrant :func:`torch.utils.checkpoint.checkpoint` does the work; it
restores the RNG state, so dropout draws the same mask when it recomputes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["call_layer", "checkpointing"]


def checkpointing(model: nn.Module, *, cached: bool = False) -> bool:
    """Whether ``model``'s layers are checkpointed in this call.

    Only while training with gradients on, and never with a KV cache (recomputing a
    layer would write its cache twice).
    """
    enabled = bool(getattr(getattr(model, "config", None), "gradient_checkpointing", False))
    return enabled and model.training and torch.is_grad_enabled() and not cached


def call_layer(layer: nn.Module, enabled: bool, *args: Any, **kwargs: Any) -> Any:
    """``layer(*args, **kwargs)``, checkpointed when ``enabled``."""
    if enabled:
        return checkpoint(layer, *args, use_reentrant=False, **kwargs)
    return layer(*args, **kwargs)
