"""Expert load of mixture-of-experts layers: tokens per expert, dropped share, router entropy.

Shape notation: ``N`` tokens, ``E`` experts, ``k`` experts per token.

A router *collapses* when it sends (nearly) every token to the same expert(s): the other
experts stop learning and the layer behaves like a dense one of ``k`` experts (Shazeer
et al., 2017, sec. 4; the load-balancing loss exists to prevent it). :func:`expert_load`
flags a layer whose busiest expert is chosen by at least ``collapse_share`` of the
tokens; a balanced top-``k`` router gives each expert about ``k / E`` of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["COLLAPSE_SHARE", "ExpertLoad", "expert_load"]

#: Share of tokens sending one expert that marks a router as collapsed.
COLLAPSE_SHARE = 0.9


@dataclass
class ExpertLoad:
    """Load of one MoE layer on one batch.

    Attributes:
        layer: index among the model's MoE layers.
        module: the MoE block's name in ``model.named_modules()``.
        tokens: tokens counted (padding left out).
        tokens_per_expert: how many tokens chose each expert (top-``k`` assignments).
        max_share: share of the tokens that chose the busiest expert (``k / E`` balanced,
            1.0 when every token chose it).
        busiest_expert: that expert's index.
        unused_experts: experts no token chose.
        router_entropy: mean entropy of the router's softmax per token, in nats
            (``log E`` for a uniform router).
        dropped_share: share of assignments capacity dispatch dropped (0 when dropless).
        collapsed: ``max_share >= collapse_share``.
    """

    layer: int
    module: str
    tokens: int
    tokens_per_expert: list[int] = field(default_factory=list)
    max_share: float = 0.0
    busiest_expert: int = 0
    unused_experts: int = 0
    router_entropy: float = 0.0
    dropped_share: float = 0.0
    collapsed: bool = False


def expert_load(
    router_logits: Tensor,
    top_k: int,
    *,
    layer: int = 0,
    module: str = "",
    mask: Tensor | None = None,
    dropped: Tensor | float | None = None,
    collapse_share: float = COLLAPSE_SHARE,
) -> ExpertLoad:
    """Load statistics of one layer from its router logits ``[N, E]``.

    Args:
        router_logits: the layer's router logits.
        top_k: experts per token.
        layer: index among the MoE layers (for the report).
        module: module name (for the report).
        mask: optional ``[N]`` (or ``[B, L]``) 1/0 mask: padding tokens are left out.
        dropped: the dropped share reported by capacity dispatch, if any.
        collapse_share: the ``max_share`` from which the router counts as collapsed.
    """
    logits = router_logits.detach().float()
    if mask is not None:
        keep = mask.reshape(-1).bool()
        if keep.numel() == logits.shape[0]:
            logits = logits[keep]
    n, e = logits.shape
    probs = torch.softmax(logits, dim=-1)  # [N, E]
    chosen = torch.topk(probs, min(top_k, e), dim=-1).indices  # [N, k]
    counts = torch.bincount(chosen.reshape(-1), minlength=e)  # [E]
    entropy = -torch.xlogy(probs, probs).sum(-1)  # [N]
    max_count = int(counts.max()) if n else 0
    share = max_count / n if n else 0.0
    return ExpertLoad(
        layer=layer,
        module=module,
        tokens=n,
        tokens_per_expert=[int(c) for c in counts],
        max_share=share,
        busiest_expert=int(counts.argmax()) if n else 0,
        unused_experts=int((counts == 0).sum()),
        router_entropy=float(entropy.mean()) if n else math.nan,
        dropped_share=float(dropped) if dropped is not None else 0.0,
        collapsed=bool(n) and e > top_k and share >= collapse_share,
    )
