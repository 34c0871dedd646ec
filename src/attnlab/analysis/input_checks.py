"""Checks of a model's inputs before a diagnosis: shapes, dtypes and masks, each with its fix.

A 1-D ``input_ids``, an ``attention_mask`` of the wrong shape, an additive float mask
where 1/0 was meant, a 0/1 float ``attn_mask`` where a bool was meant, a sequence whose
mask blanks every key: each is an :class:`Issue` whose ``fix`` says what to pass instead.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["Issue", "check_attn_mask", "check_inputs"]


@dataclass
class Issue:
    """One finding.

    Attributes:
        kind: a short tag (``"nonfinite"``, ``"mask"``, ``"shape"``, ``"row_sum"``,
            ``"fully_masked"``, ``"overflow"``, ``"error"``).
        where: the module or input it concerns.
        message: what is wrong, with the values.
        fix: what to do about it.
    """

    kind: str
    where: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"[{self.kind}] {self.where}: {self.message}\n    fix: {self.fix}"


def check_inputs(model: nn.Module, inputs: Mapping[str, Any]) -> list[Issue]:
    issues: list[Issue] = []
    ids = inputs.get("input_ids")
    if isinstance(ids, Tensor):
        if ids.dim() == 1:
            issues.append(
                Issue(
                    "shape",
                    "input_ids",
                    f"input_ids has shape {tuple(ids.shape)}; models take (batch, seq_len)",
                    "add the batch dimension: input_ids.unsqueeze(0)",
                )
            )
        if ids.is_floating_point():
            issues.append(
                Issue(
                    "dtype",
                    "input_ids",
                    f"input_ids is {ids.dtype}; token ids are integers",
                    "input_ids.long()",
                )
            )
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if vocab is not None and ids.numel() and not ids.is_floating_point():
            hi = int(ids.max())
            if hi >= vocab or int(ids.min()) < 0:
                issues.append(
                    Issue(
                        "shape",
                        "input_ids",
                        f"ids range over [{int(ids.min())}, {hi}] but vocab_size is {vocab}",
                        "use the tokenizer that belongs to this model",
                    )
                )
    am = inputs.get("attention_mask")
    if isinstance(am, Tensor):
        if isinstance(ids, Tensor) and ids.dim() == 2 and tuple(am.shape) != tuple(ids.shape):
            issues.append(
                Issue(
                    "shape",
                    "attention_mask",
                    f"attention_mask has shape {tuple(am.shape)}, input_ids {tuple(ids.shape)}",
                    "build both with the same tokenizer call (padding=True), or pass "
                    "attention_mask of shape (batch, seq_len) with 1 = token, 0 = padding",
                )
            )
        if am.is_floating_point():
            vals = torch.unique(am.detach()).tolist()
            if any(v not in (0.0, 1.0) for v in vals):
                shown = [round(v, 3) if math.isfinite(v) else v for v in vals[:4]]
                issues.append(
                    Issue(
                        "mask",
                        "attention_mask",
                        f"attention_mask holds {shown}: an additive float mask (0 = keep, "
                        "-inf/-1e4 = drop), but attention_mask means 1 = token, 0 = padding",
                        "pass (mask == 0).long() as attention_mask, or the additive mask as attn_mask",
                    )
                )
        if am.dim() == 2 and am.numel():
            blank = (am == 0).all(dim=-1) if not am.is_floating_point() else (am == 0).all(-1)
            for b in blank.nonzero().flatten().tolist():
                issues.append(
                    Issue(
                        "fully_masked",
                        f"attention_mask[{b}]",
                        f"sequence {b} has attention_mask all 0: every query of it has no key "
                        "to attend to (attnlab returns zeros there; torch sdpa returns NaN)",
                        "every sequence needs at least one real token marked 1; check the "
                        "padding side and the tokenizer call",
                    )
                )
    for key in ("attn_mask", "mask"):
        m = inputs.get(key)
        if isinstance(m, Tensor):
            issues += check_attn_mask(m, key)
    return issues


def check_attn_mask(mask: Tensor, where: str) -> list[Issue]:
    issues: list[Issue] = []
    if mask.is_floating_point():
        vals = torch.unique(mask.detach())
        if vals.numel() <= 2 and bool(((vals == 0) | (vals == 1)).all()):
            issues.append(
                Issue(
                    "mask",
                    where,
                    f"{where} is a {mask.dtype} mask of 0 and 1: a float mask is ADDED to the "
                    "scores, so the 0 entries are not masked at all (they score 1 lower)",
                    f"pass {where}.bool() (True = attend), or an additive mask "
                    f"{where}.log() (0 = keep, -inf = drop)",
                )
            )
    elif mask.dtype == torch.bool and mask.dim() >= 1 and mask.numel():
        blank = ~mask.any(dim=-1)
        n = int(blank.sum())
        if n:
            issues.append(
                Issue(
                    "fully_masked",
                    where,
                    f"{n} row(s) of {where} allow no key at all",
                    "give every query at least one key (for instance itself); fully masked "
                    "rows return zeros in attnlab and NaN in torch sdpa",
                )
            )
    return issues
