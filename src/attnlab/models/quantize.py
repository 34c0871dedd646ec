"""Quantize a whole model's linear layers (and embeddings) through the one linear factory.

:func:`quantize_model` replaces every ``nn.Linear`` of a model (attention projections,
MLPs, shared experts, an untied LM head) with the layer :func:`attnlab.modules.linear.
convert_linear` makes, and the token embeddings with a :class:`QuantEmbedding` (which is
also the LM head of a tied model). What stayed float and why is recorded in
``model.quantization`` beside the spec, so that a saved model says how it was made.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from attnlab.backends.qmatmul import LinearChoice, choose_kernel
from attnlab.modules.experts import Experts
from attnlab.modules.linear import LinearSpec, convert_linear
from attnlab.modules.quant_experts import QuantExperts
from attnlab.modules.quant_linear import QuantEmbedding, QuantLinear

__all__ = ["kernel_report", "quantize_model", "quantized_layers", "set_compute"]

log = logging.getLogger(__name__)


def _fits(spec: LinearSpec, in_features: int) -> bool:
    g = spec.effective_group
    return g is None or (in_features % g == 0 and (spec.weights != "int4" or g % 2 == 0))


def quantize_model(
    model: nn.Module,
    quantize: LinearSpec | str,
    *,
    embeddings: bool = True,
    experts: bool = True,
) -> nn.Module:
    """Quantize ``model``'s linear layers in place (weight-only) and return it.

    Args:
        model: any attnlab model.
        quantize: ``"int8"``, ``"int8:g32"``, ``"int4"`` (groups of 32), ``"int4:g64"``...
            or a :class:`LinearSpec`.
        embeddings: also quantize ``embed_tokens`` (the LM head too when tied).
        experts: also quantize MoE experts (:class:`~attnlab.modules.quant_experts.QuantExperts`,
            one quantized layer per expert matrix); routers stay float.

    Returns:
        ``model``, with ``model.quantization`` = ``{"weights", "group_size",
        "float_layers"}`` (layers kept float: their width is not a multiple of the group).

    Raises:
        ValueError: a bad spec, or a model that is already quantized differently.
    """
    spec = LinearSpec.parse(quantize)
    if not spec.quantized:
        raise ValueError("quantize='float' asks for no quantization; pass 'int8' or 'int4'")
    kept: list[str] = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, QuantLinear | QuantExperts):
                continue  # already quantized (a GGUF file's blocks): never rounded twice
            if isinstance(child, Experts) and experts:
                if _fits(spec, child.embed_dim) and _fits(spec, child.hidden_dim):
                    setattr(module, child_name, QuantExperts.from_float(child, spec))
                else:
                    kept.append(full)
                continue
            if isinstance(child, nn.Linear):
                if not _fits(spec, child.in_features):
                    kept.append(full)
                    continue
                setattr(module, child_name, convert_linear(child, spec))
    emb = getattr(model, "embed_tokens", None)
    if embeddings and isinstance(emb, nn.Embedding):
        if _fits(spec, emb.embedding_dim):
            model.embed_tokens = QuantEmbedding.from_float(  # type: ignore[assignment]
                emb,
                kind=spec.weights,
                group_size=spec.effective_group,
                kernel=spec.kernel,
                compute=spec.compute,
            )
        else:
            kept.append("embed_tokens")
    if kept:
        log.info("kept float (width not a multiple of the group): %s", ", ".join(kept))
    model.quantization = {**spec.to_dict(), "float_layers": kept}  # type: ignore[assignment]
    return model


def quantized_layers(model: nn.Module) -> dict[str, QuantLinear]:
    """Every quantized layer of ``model`` by its qualified name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def set_compute(model: nn.Module, compute: str) -> nn.Module:
    """Set every quantized layer's compute policy (``"int8"``: int8 activation blocks, as
    llama.cpp; see :mod:`attnlab.backends.qmatmul`) and return ``model``.

    Raises:
        ValueError: an unknown policy.
    """
    from attnlab.backends.qmatmul import COMPUTE_POLICIES

    if compute not in COMPUTE_POLICIES:
        raise ValueError(f"compute must be one of {list(COMPUTE_POLICIES)}, got {compute!r}")
    for layer in quantized_layers(model).values():
        layer.compute = compute
    return model


def measure_kernels(
    model: nn.Module, rows: int, x_dtype: torch.dtype = torch.float32
) -> dict[str, LinearChoice]:
    """Choose (measure, where not yet memoised) every quantized layer's kernel for
    ``rows`` activations, eagerly: a graph compiled afterwards reads these choices
    instead of falling back to a fixed rule. Each chosen kernel runs once on a zero row,
    so that it builds its layout of the weights (``kernel_form``) now: the choice is
    memoised per shape, so the other layers of a measured shape would otherwise build
    theirs while a graph is traced, where the layout's checks cannot run. Returns each
    layer's choice."""
    from attnlab.backends.qmatmul import run_kernel

    out: dict[str, LinearChoice] = {}
    for name, layer in quantized_layers(model).items():
        choice = choose_kernel(layer, rows, x_dtype, kernel=layer.kernel, compute=layer.compute)
        # a marker among the forms: cleared with them when the weights change
        warm = (f"warm:{choice.chosen}", choice.compute_dtype)
        if warm not in layer._forms:
            with torch.no_grad():
                run_kernel(layer, torch.zeros(1, layer.in_features, dtype=x_dtype), choice)
            layer._forms[warm] = ()
        out[name] = choice
    return out


def kernel_report(model: nn.Module) -> dict[str, Any]:
    """Which kernel ran each quantized layer's last call, counted: ``{kernel: layers}``,
    and one example decision per kernel under ``"why"`` (measured timings, dtype reason)."""
    counts: dict[str, int] = {}
    why: dict[str, str] = {}
    for layer in quantized_layers(model).values():
        c = layer.last_choice
        if c is None:
            continue
        counts[c.chosen] = counts.get(c.chosen, 0) + 1
        why.setdefault(c.chosen, str(c))
    return {"kernels": counts, "why": why}
