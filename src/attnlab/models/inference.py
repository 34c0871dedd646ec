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
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.backends.linear_pack import PackedLinear
from attnlab.modules.packed_linear import PackedLinearLayer

__all__ = ["DEFAULT_ROWS", "pack_model", "packed_linears", "packing_report", "unpack_model"]

log = logging.getLogger(__name__)

#: the row counts packed for by default (the serving engine's decode buckets)
DEFAULT_ROWS = (1, 2, 4, 8, 16, 32)


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
    unpack_model(model)
    kept: list[str] = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not nn.Linear:
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
    parameters, no packed head) and return ``model``."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, PackedLinearLayer):
                setattr(module, child_name, child.unpack())
    if getattr(model, "packed_head", None) is not None:
        model.packed_head = None  # type: ignore[assignment]
    return model


def packed_linears(model: nn.Module) -> dict[str, PackedLinear]:
    """Every packed linear of ``model`` by its qualified name (a tied head as
    ``"packed_head"``)."""
    out = {n: m.packed for n, m in model.named_modules() if isinstance(m, PackedLinearLayer)}
    head = getattr(model, "packed_head", None)
    if isinstance(head, PackedLinear):
        out["packed_head"] = head
    return out


def packing_report(model: nn.Module) -> dict[str, Any]:
    """How ``model``'s packed linears multiply: ``{"kernels": {rows: {kernel: layers}},
    "why": {rows: {kernel: one decision as text}}, "extra_bytes": int}``."""
    kernels: dict[int, dict[str, int]] = {}
    why: dict[int, dict[str, str]] = {}
    extra = 0
    for p in packed_linears(model).values():
        extra += p.extra_bytes
        for b, c in p.choices.items():
            counts = kernels.setdefault(b, {})
            counts[c.chosen] = counts.get(c.chosen, 0) + 1
            why.setdefault(b, {}).setdefault(c.chosen, f"[{p.out_features}, {p.in_features}]: {c}")
    return {
        "kernels": dict(sorted(kernels.items())),
        "why": dict(sorted(why.items())),
        "extra_bytes": extra,
    }
