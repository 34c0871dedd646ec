"""Fuse a model's q/k/v and gate/up projections for inference, and undo it.

:func:`fuse_projections` gives every self-attention
(:class:`~attnlab.modules.attention.MultiHeadAttention`, not the ones reached as
``cross_attention``, whose keys/values come from another input) a ``fused_qkv`` and every
gated MLP (:class:`~attnlab.modules.mlp.GatedFeedForward`) a ``fused_gate_up``
:class:`~attnlab.modules.fused_linear.FusedProjection`, which their forwards use in place
of the separate calls; a decoder layer then makes 4 matmul calls instead of 7. The
parameters, the state dict and ``save``/``to_hf``/``to_gguf`` are untouched (the fused
weights are derived copies, not parameters). Called by
:func:`attnlab.models.inference.pack_model` (``fuse=``), undone by
:func:`unfuse_projections` (and ``unpack_model``).

Left unfused, with the reason logged and returned: layers with a LoRA adapter (merge it
first), layers of different dtypes, devices or kinds, quantized layers whose class cannot
concatenate, cross-attention. MoE experts keep their own stacked weights.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from torch import nn

from attnlab.modules.attention import MultiHeadAttention
from attnlab.modules.fused_linear import FusedProjection, fusion_refusal
from attnlab.modules.mlp import GatedFeedForward
from attnlab.modules.quant_linear import QuantLinear

__all__ = ["fuse_projections", "fused_projections", "unfuse_projections"]

log = logging.getLogger(__name__)

#: (module class, attribute of the fused projection, the layers it fuses)
_GROUPS: tuple[tuple[type[nn.Module], str, tuple[str, ...]], ...] = (
    (MultiHeadAttention, "fused_qkv", ("q_proj", "k_proj", "v_proj")),
    (GatedFeedForward, "fused_gate_up", ("gate_proj", "up_proj")),
)


def _is_cross(name: str) -> bool:
    return name.rsplit(".", 1)[-1] == "cross_attention"


def fuse_projections(
    model: nn.Module,
    *,
    rows: Sequence[int] = (1, 2, 4, 8, 16, 32),
    kernel: str = "auto",
    quantized_only: bool = False,
) -> dict[str, str]:
    """Fuse ``model``'s q/k/v and gate/up projections in place (again, where fused before).

    Args:
        model: any attnlab model, in eval mode.
        rows: the row counts a float fused weight is laid out for.
        kernel: ``"auto"`` or a kernel of :data:`attnlab.backends.linear_pack.GEMM_KERNELS`.
        quantized_only: fuse only groups of quantized layers (what
            :func:`~attnlab.models.inference.pack_model` does by default); float groups
            are left as they are, without a reason recorded.

    Returns:
        ``{module name: why it was left unfused}`` (empty when every group fused).

    Raises:
        ValueError: ``model`` is in training mode.
    """
    if model.training:
        raise ValueError(
            "fuse_projections prepares a model for inference: the model is in training mode "
            "(call model.eval() first)"
        )
    left: dict[str, str] = {}
    for name, module in model.named_modules():
        for cls, attr, parts in _GROUPS:
            if not isinstance(module, cls):
                continue
            setattr(module, attr, None)
            if cls is MultiHeadAttention and _is_cross(name):
                left[name] = "cross-attention (keys/values come from another input)"
                continue
            layers = [getattr(module, p) for p in parts]
            if quantized_only and not all(isinstance(x, QuantLinear) for x in layers):
                continue
            names = [f"{name}.{p}" if name else p for p in parts]
            why = fusion_refusal(layers, names)
            if why is not None:
                left[name] = why
                continue
            setattr(
                module, attr, FusedProjection(layers=layers, names=names, rows=rows, kernel=kernel)
            )
    if left:
        log.info("left unfused: %s", "; ".join(f"{n}: {w}" for n, w in left.items()))
    return left


def unfuse_projections(model: nn.Module) -> nn.Module:
    """Drop every fused projection of ``model`` (the separate layers run again); returns it."""
    for module in model.modules():
        for cls, attr, _ in _GROUPS:
            if isinstance(module, cls):
                setattr(module, attr, None)
    return model


def fused_projections(model: nn.Module) -> dict[str, FusedProjection]:
    """Every fused projection of ``model`` by qualified name (``...self_attention.fused_qkv``)."""
    out: dict[str, FusedProjection] = {}
    for name, module in model.named_modules():
        for cls, attr, _ in _GROUPS:
            fused = getattr(module, attr, None) if isinstance(module, cls) else None
            if isinstance(fused, FusedProjection):
                out[f"{name}.{attr}" if name else attr] = fused
    return out
