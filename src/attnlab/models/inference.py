"""Prepare a model's float linears for few-row inference (decode steps), and undo it.

:func:`pack_model` replaces every float ``nn.Linear`` of a model (attention projections,
MLPs, routers, an untied LM head) with a
:class:`~attnlab.modules.packed_linear.PackedLinearLayer` over the same parameters, and
gives a tied LM head (the token embeddings) a
:class:`~attnlab.backends.linear_pack.PackedLinear` of its own, read by
``DecoderLM.lm_logits``; each layer's kernel is measured per row bucket
(:mod:`attnlab.backends.linear_pack`). Parameters, the state dict and tying are unchanged.
Packing is for inference: it refuses a model in training mode, a packed layer refuses a
call that needs gradients, and :func:`unpack_model` restores the plain layers.

With ``fuse=True`` it also fuses each self-attention's q/k/v and each gated MLP's gate/up
into one laid-out weight (:func:`attnlab.models.fuse.fuse_projections`: 4 matmul calls per
decoder layer instead of 7); ``ATTNLAB_FUSE=1`` in the environment does it for the callers
that pack on their own (the serving decode buckets, compiled ``generate``), and
``ATTNLAB_FUSE=0`` turns it off. Unless told, only groups of quantized layers are fused
(:data:`FUSE_QUANTIZED_BY_DEFAULT`, measured faster); float groups are not
(:data:`FUSE_BY_DEFAULT`: not measured faster in every decode path). The layers a fused
float weight replaces are left as plain ``nn.Linear`` (their forward is not called while
it is fused), so fusing costs one copy of those weights more than packing them would.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.backends.linear_pack import PackedLinear
from attnlab.models.fuse import fuse_projections, fused_projections, unfuse_projections
from attnlab.modules.packed_linear import PackedLinearLayer

__all__ = [
    "DEFAULT_ROWS",
    "FUSE_BY_DEFAULT",
    "FUSE_QUANTIZED_BY_DEFAULT",
    "default_fuse",
    "pack_model",
    "packed_linears",
    "packing_report",
    "unpack_model",
]

log = logging.getLogger(__name__)

#: the row counts packed for by default (the serving engine's decode buckets)
DEFAULT_ROWS = (1, 2, 4, 8, 16, 32)

#: whether :func:`pack_model` fuses q/k/v and gate/up unless told: off, because it was not
#: measured faster everywhere (SmolLM2's 8-row serving bucket 1.13x, but compiled 8-row
#: ``generate`` 0.82-0.90x; docs/benchmarks.md, "Fused q/k/v and gate/up")
FUSE_BY_DEFAULT = False
#: whether :func:`pack_model` fuses the groups of *quantized* layers unless told: on. With
#: int8 activations each quantized call pays a fixed cost (quantizing the activations, one
#: OpenMP fork), and one call per group is measured faster: SmolLM2 from the Q4_1/Q8_0
#: GGUF files decoded 108.7 / 102.9 tok/s fused against 93.2 / 88.1 separate at two
#: threads on a quiet machine (docs/benchmarks.md, "Sixth stop: the lead's quiet runs")
FUSE_QUANTIZED_BY_DEFAULT = True


def default_fuse() -> bool:
    """:data:`FUSE_BY_DEFAULT`, unless ``ATTNLAB_FUSE`` is set to ``1`` or ``0``.

    Raises:
        ValueError: ``ATTNLAB_FUSE`` set to anything else.
    """
    value = os.environ.get("ATTNLAB_FUSE")
    if value is None or value == "":
        return FUSE_BY_DEFAULT
    if value not in ("0", "1"):
        raise ValueError(f"ATTNLAB_FUSE must be 1 (fuse q/k/v and gate/up) or 0, got {value!r}")
    return value == "1"


def _refusal(weight: Tensor) -> str | None:
    """Why a weight is left unpacked, or None."""
    if weight.device.type != "cpu":
        return f"on {weight.device}"
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return f"{weight.dtype} weights"
    return None


def pack_model(
    model: nn.Module,
    *,
    rows: Sequence[int] = DEFAULT_ROWS,
    kernel: str = "auto",
    head: bool = True,
    fuse: bool | None = None,
) -> nn.Module:
    """Pack ``model``'s float linears for ``rows``-row calls, in place, and return it.

    Args:
        model: any attnlab model, in eval mode.
        rows: the row counts its decode steps run (e.g. the serving buckets, or the batch
            size of ``generate``); other counts still run, with the nearest bucket's
            choice (or ``F.linear`` past 32 rows).
        kernel: ``"auto"`` (measured) or a kernel of
            :data:`~attnlab.backends.linear_pack.GEMM_KERNELS` for every layer.
        head: also pack a tied LM head (the embeddings' matrix).
        fuse: fuse q/k/v and gate/up into one laid-out weight each
            (:func:`attnlab.models.fuse.fuse_projections`); None: :func:`default_fuse`
            (``ATTNLAB_FUSE``), and where that is unset, the groups of quantized layers
            only (:data:`FUSE_QUANTIZED_BY_DEFAULT`).

    Returns:
        ``model``; a layer already packed is packed again for ``rows``. Layers left as
        they were (another device or dtype) are logged with the reason.

    Raises:
        ValueError: ``model`` is in training mode, or bad ``rows``/``kernel``.
    """
    if model.training:
        raise ValueError(
            "pack_model prepares a model for inference: the model is in training mode "
            "(call model.eval() first; packed layers refuse calls that need gradients)"
        )
    quantized_only = False
    if fuse is None:
        told = os.environ.get("ATTNLAB_FUSE") not in (None, "")
        fuse = default_fuse()
        if not fuse and not told and FUSE_QUANTIZED_BY_DEFAULT:
            fuse = quantized_only = True
    elif not isinstance(fuse, bool):
        raise TypeError(f"fuse must be a bool or None, got {fuse!r}")
    unpack_model(model)
    if fuse:
        fuse_projections(model, rows=rows, kernel=kernel, quantized_only=quantized_only)
    fused = {id(layer) for f in fused_projections(model).values() for layer in f.layers}
    kept: list[str] = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not nn.Linear or id(child) in fused:
                continue
            full = f"{name}.{child_name}" if name else child_name
            why = _refusal(child.weight)
            if why is not None:
                kept.append(f"{full} ({why})")
                continue
            setattr(module, child_name, PackedLinearLayer(linear=child, rows=rows, kernel=kernel))
    emb = getattr(model, "embed_tokens", None)
    if (
        head
        and hasattr(model, "packed_head")
        and getattr(model, "lm_head", 0) is None
        and type(emb) is nn.Embedding
    ):
        why = _refusal(emb.weight)
        if why is None:
            model.packed_head = PackedLinear(emb.weight, rows=rows, kernel=kernel)  # type: ignore[assignment]
        else:
            kept.append(f"tied head ({why})")
    if kept:
        log.info("left unpacked: %s", ", ".join(kept))
    return model


def unpack_model(model: nn.Module) -> nn.Module:
    """Undo :func:`pack_model` in place (plain ``nn.Linear`` layers over the same
    parameters, no fused projections, no packed head) and return ``model``."""
    unfuse_projections(model)
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, PackedLinearLayer):
                setattr(module, child_name, child.unpack())
    if getattr(model, "packed_head", None) is not None:
        model.packed_head = None  # type: ignore[assignment]
    return model


def packed_linears(model: nn.Module) -> dict[str, PackedLinear]:
    """Every packed linear of ``model`` by its qualified name (a fused projection's as
    ``"....fused_qkv"``, a tied head as ``"packed_head"``)."""
    out = {n: m.packed for n, m in model.named_modules() if isinstance(m, PackedLinearLayer)}
    out.update({n: f.packed for n, f in fused_projections(model).items() if f.packed is not None})
    head = getattr(model, "packed_head", None)
    if isinstance(head, PackedLinear):
        out["packed_head"] = head
    return out


def packing_report(model: nn.Module) -> dict[str, Any]:
    """How ``model``'s packed linears multiply: ``{"kernels": {rows: {kernel: layers}},
    "why": {rows: {kernel: one decision as text}}, "fused": number of fused projections,
    "extra_bytes": int}`` (the fused copies counted in the bytes)."""
    kernels: dict[int, dict[str, int]] = {}
    why: dict[int, dict[str, str]] = {}
    fused = fused_projections(model)
    extra = sum(f.extra_bytes for f in fused.values())
    ids = {id(f.packed) for f in fused.values()}
    for p in packed_linears(model).values():
        extra += 0 if id(p) in ids else p.extra_bytes
        for b, c in p.choices.items():
            counts = kernels.setdefault(b, {})
            counts[c.chosen] = counts.get(c.chosen, 0) + 1
            why.setdefault(b, {}).setdefault(c.chosen, f"[{p.out_features}, {p.in_features}]: {c}")
    return {
        "kernels": dict(sorted(kernels.items())),
        "why": dict(sorted(why.items())),
        "fused": len(fused),
        "extra_bytes": extra,
    }
