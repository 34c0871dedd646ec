"""Batched expert weights and the router that picks experts.

Shape notation: ``N`` tokens, ``D`` width, ``E`` experts, ``k`` experts per token,
``F`` expert inner width, ``F_in`` = ``2F`` (gated) or ``F``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from attnlab.functional._checks import check_positive_int
from attnlab.functional.expert_dispatch import (
    CapacityResult,
    moe_capacity,
    moe_dropless,
    moe_expert_choice,
    moe_reference,
)
from attnlab.functional.routing import (
    ROUTERS,
    ExpertChoice,
    TokenChoice,
    expert_capacity,
    input_jitter,
    logit_noise,
    route,
)
from attnlab.modules.activations import get_activation

__all__ = ["Experts", "Router"]


class Experts(nn.Module):
    """``E`` feed-forward experts with their weights stored batched, ``[E, ...]``.

    Gated experts (``gated=True``, SwiGLU with ``activation="silu"``: Mixtral, Qwen2-MoE,
    OLMoE) hold ``w_in [E, 2F, D]`` (gate rows, then up rows, transformers'
    ``gate_up_proj``) and ``w_out [E, D, F]``; plain experts (Switch, GELU/ReLU) hold
    ``w_in [E, F, D]``. The batched layout lets dispatch run all experts as grouped
    matmuls (:mod:`attnlab.functional.expert_dispatch`).

    Args:
        num_experts: ``E``.
        embed_dim: ``D``.
        hidden_dim: ``F``.
        activation: activation name.
        gated: gated (GLU) experts.
    """

    def __init__(
        self,
        *,
        num_experts: int,
        embed_dim: int,
        hidden_dim: int,
        activation: str = "silu",
        gated: bool = True,
    ) -> None:
        super().__init__()
        check_positive_int("num_experts", num_experts)
        check_positive_int("embed_dim", embed_dim)
        check_positive_int("hidden_dim", hidden_dim)
        self.num_experts = num_experts
        self.embed_dim = embed_dim
        self.hidden_dim = hidden_dim
        self.gated = gated
        self.activation_name = activation
        self.act = get_activation(activation)
        f_in = 2 * hidden_dim if gated else hidden_dim
        self.w_in = nn.Parameter(torch.empty(num_experts, f_in, embed_dim))
        self.w_out = nn.Parameter(torch.empty(num_experts, embed_dim, hidden_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default initialisation, expert by expert."""
        for w in (self.w_in, self.w_out):
            bound = 1.0 / math.sqrt(w.shape[-1])
            nn.init.uniform_(w, -bound, bound)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, embed_dim={self.embed_dim}, "
            f"hidden_dim={self.hidden_dim}, activation={self.activation_name!r}, gated={self.gated}"
        )

    def forward(
        self,
        x: Tensor,
        routing: TokenChoice | ExpertChoice,
        *,
        dispatch: str = "dropless",
        capacity: int = 0,
    ) -> tuple[Tensor, Tensor | None]:
        """``[N, D] -> ([N, D], dropped share or None)``.

        Args:
            x: the tokens.
            routing: token-choice ``[N, k]`` or expert-choice ``[E, C]`` routing.
            dispatch: ``"dropless"``, ``"capacity"`` (needs ``capacity``) or
                ``"reference"`` (the per-token loop).
            capacity: slots per expert for ``"capacity"``.
        """
        act, gated, w_in, w_out = self.act, self.gated, self.w_in, self.w_out
        if isinstance(routing, ExpertChoice):
            return moe_expert_choice(x, routing, w_in, w_out, activation=act, gated=gated), None
        if dispatch == "dropless":
            return moe_dropless(x, routing, w_in, w_out, activation=act, gated=gated), None
        if dispatch == "capacity":
            res: CapacityResult = moe_capacity(
                x, routing, w_in, w_out, capacity=capacity, activation=act, gated=gated
            )
            return res.output, res.dropped
        if dispatch == "reference":
            return moe_reference(x, routing, w_in, w_out, activation=act, gated=gated), None
        raise ValueError(
            f"dispatch must be 'dropless', 'capacity' or 'reference', got {dispatch!r}"
        )


class Router(nn.Module):
    """A linear gate ``logits = x W^T`` (``W [E, D]``) and a routing rule.

    Args:
        embed_dim: ``D``.
        num_experts: ``E``.
        top_k: experts per token (expert choice: the average per token).
        router: a name in :data:`attnlab.functional.routing.ROUTERS`.
        normalize: renormalise the top-k probabilities (``"softmax_topk"``).
        capacity_factor: expert choice's capacity factor.
        jitter: training-time multiplicative noise on the router input (Switch).
        noise_std: training-time Gaussian noise on the logits (Shazeer et al., 2017).
    """

    def __init__(
        self,
        *,
        embed_dim: int,
        num_experts: int,
        top_k: int,
        router: str = "softmax_topk",
        normalize: bool = True,
        capacity_factor: float = 1.0,
        jitter: float = 0.0,
        noise_std: float = 0.0,
    ) -> None:
        super().__init__()
        check_positive_int("embed_dim", embed_dim)
        check_positive_int("num_experts", num_experts)
        check_positive_int("top_k", top_k)
        if router not in ROUTERS:
            raise ValueError(f"router must be one of {list(ROUTERS)}, got {router!r}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.router = router
        self.normalize = normalize
        self.capacity_factor = capacity_factor
        self.jitter = jitter
        self.noise_std = noise_std
        self.weight = nn.Parameter(torch.empty(num_experts, embed_dim))
        nn.init.uniform_(self.weight, -1.0 / math.sqrt(embed_dim), 1.0 / math.sqrt(embed_dim))

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, router={self.router!r}, "
            f"normalize={self.normalize}"
        )

    def forward(self, x: Tensor) -> tuple[Tensor, TokenChoice | ExpertChoice]:
        """``[N, D] -> (logits [N, E], routing)``; noise only in training mode."""
        h = input_jitter(x, self.jitter) if self.training else x
        logits = nn.functional.linear(h, self.weight)  # [N, E]
        scored = logit_noise(logits, self.noise_std) if self.training else logits
        capacity = 0
        if self.router == "expert_choice":
            capacity = min(
                x.shape[0],
                expert_capacity(x.shape[0], self.num_experts, self.top_k, self.capacity_factor),
            )
        return logits, route(
            scored, self.top_k, router=self.router, normalize=self.normalize, capacity=capacity
        )
