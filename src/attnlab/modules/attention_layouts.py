"""Attention weights stored in other layouts, converted to :class:`MultiHeadAttention`'s.

* ``"per_head"``: the tutorial's layout, one ``nn.Linear`` per head and projection
  (``heads.{i}.q.weight [h_d, D]``, ...), plus ``output_linear``;
* ``"packed"``: torch ``nn.MultiheadAttention``'s fused ``in_proj_weight [3*D, D]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from attnlab.modules.attention import MultiHeadAttention

__all__ = ["layout_state_dict"]


def layout_state_dict(
    module: MultiHeadAttention, state_dict: Mapping[str, Tensor], layout: str
) -> dict[str, Tensor]:
    """``state_dict`` in ``layout`` as ``module``'s own keys, checked against its shapes.

    Raises:
        ValueError: unknown layout, missing keys or shapes that do not fit.
    """
    if layout == "native":
        converted = dict(state_dict)
    elif layout == "per_head":
        converted = _from_per_head(module, state_dict)
    elif layout == "packed":
        converted = _from_packed(module, state_dict)
    else:
        raise ValueError(f"unknown layout {layout!r}; expected 'native', 'per_head' or 'packed'")
    own = module.state_dict()
    missing = sorted(set(own) - set(converted))
    unexpected = sorted(set(converted) - set(own))
    if missing or unexpected:
        raise ValueError(f"layout {layout!r}: missing keys {missing}, unexpected keys {unexpected}")
    for name, t in converted.items():
        if t.shape != own[name].shape:
            raise ValueError(
                f"layout {layout!r}: {name} has shape {tuple(t.shape)}, expected "
                f"{tuple(own[name].shape)}"
            )
    return converted


def _from_per_head(module: MultiHeadAttention, sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    if module.num_kv_heads != module.num_heads:
        raise ValueError(
            "the per-head layout has one key/value projection per query head; it cannot "
            f"load into num_kv_heads={module.num_kv_heads} < num_heads={module.num_heads}"
        )
    n = sum(1 for k in sd if k.startswith("heads.") and k.endswith(".q.weight"))
    if n != module.num_heads:
        raise ValueError(f"per-head state dict has {n} heads, the module has {module.num_heads}")
    out: dict[str, Tensor] = {}
    for src, dst in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
        for kind in ("weight", "bias"):
            keys = [f"heads.{i}.{src}.{kind}" for i in range(n)]
            if all(k in sd for k in keys):
                out[f"{dst}.{kind}"] = torch.cat([sd[k] for k in keys], dim=0)
    for kind in ("weight", "bias"):
        if f"output_linear.{kind}" in sd:
            out[f"out_proj.{kind}"] = sd[f"output_linear.{kind}"]
    return out


def _from_packed(module: MultiHeadAttention, sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    if "in_proj_weight" not in sd:
        raise ValueError(f"packed layout needs 'in_proj_weight', got keys {sorted(sd)}")
    qd, kd = module.num_heads * module.head_dim, module.num_kv_heads * module.head_dim
    sizes = [qd, kd, kd]
    w = sd["in_proj_weight"]
    if w.shape[0] != sum(sizes):
        raise ValueError(
            f"in_proj_weight has {w.shape[0]} rows, expected {sum(sizes)} (q {qd} + k {kd} + v {kd})"
        )
    out = dict(zip(("q_proj.weight", "k_proj.weight", "v_proj.weight"), w.split(sizes, dim=0)))
    if "in_proj_bias" in sd and sd["in_proj_bias"] is not None:
        out |= dict(
            zip(("q_proj.bias", "k_proj.bias", "v_proj.bias"), sd["in_proj_bias"].split(sizes))
        )
    for kind in ("weight", "bias"):
        if f"out_proj.{kind}" in sd:
            out[f"out_proj.{kind}"] = sd[f"out_proj.{kind}"]
    return out
