"""A mixture-of-experts feed-forward block: router, routed experts, optional shared expert.

Shape notation: ``B`` batch, ``L`` tokens, ``N = B * L``, ``D`` width, ``E`` experts.

``y = sum_j g_j(x) * expert_{e_j}(x) [+ sigmoid(w_s . x) * shared(x)]``: the sparse
feed-forward of Shazeer et al. (2017) as Mixtral uses it (Jiang et al., 2024), with the
always-active shared expert of Qwen2-MoE (gated) and DeepSeekMoE (Dai et al., 2024,
ungated).
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor, nn

from attnlab.functional.routing import expert_capacity
from attnlab.modules.experts import Experts, Router

__all__ = ["MoEBlock", "MoEOutput"]

DISPATCHES = ("dropless", "capacity", "reference")


class MoEOutput(NamedTuple):
    """Output of :class:`MoEBlock`.

    Attributes:
        hidden: ``[B, L, D]``.
        router_logits: ``[N, E]`` (batch-major tokens, as transformers returns them).
        dropped: share of assignments dropped by capacity dispatch (float32 scalar), or
            None when nothing can be dropped.
    """

    hidden: Tensor
    router_logits: Tensor
    dropped: Tensor | None


class MoEBlock(nn.Module):
    """Router + batched experts (+ shared expert), in place of a dense feed-forward.

    Args:
        router: the :class:`Router`.
        experts: the :class:`Experts`.
        shared_expert: an always-active feed-forward (Qwen2-MoE, DeepSeekMoE), or None.
        shared_expert_gate: ``nn.Linear(D, 1)`` whose sigmoid scales the shared expert
            (Qwen2-MoE), or None.
        dispatch: ``"dropless"``, ``"capacity"`` or ``"reference"``, used in training
            mode; evaluation always runs dropless, so a token's output never depends on
            the rest of the batch and cached decoding equals the full forward.
        capacity_factor: capacity dispatch's ``C = ceil(factor * k * N / E)``.
    """

    def __init__(
        self,
        *,
        router: Router,
        experts: Experts,
        shared_expert: nn.Module | None = None,
        shared_expert_gate: nn.Module | None = None,
        dispatch: str = "dropless",
        capacity_factor: float = 1.25,
    ) -> None:
        super().__init__()
        if dispatch not in DISPATCHES:
            raise ValueError(f"dispatch must be one of {list(DISPATCHES)}, got {dispatch!r}")
        if router.num_experts != experts.num_experts:
            raise ValueError(
                f"router has {router.num_experts} experts, experts has {experts.num_experts}"
            )
        if shared_expert_gate is not None and shared_expert is None:
            raise ValueError("shared_expert_gate needs a shared_expert")
        self.router = router
        self.experts = experts
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate
        self.dispatch = dispatch
        self.capacity_factor = capacity_factor

    def extra_repr(self) -> str:
        return f"dispatch={self.dispatch!r}, capacity_factor={self.capacity_factor}"

    def forward(self, x: Tensor, *, dispatch: str | None = None) -> MoEOutput:
        """``[B, L, D] -> MoEOutput``.

        Args:
            x: the tokens.
            dispatch: override the dispatch for this call (any mode); default: the
                block's dispatch in training, ``"dropless"`` in evaluation.
        """
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, D]
        logits, routing = self.router(flat)
        mode = dispatch or (self.dispatch if self.training else "dropless")
        capacity = 0
        if mode == "capacity":
            capacity = expert_capacity(
                flat.shape[0], self.router.num_experts, self.router.top_k, self.capacity_factor
            )
        y, dropped = self.experts(flat, routing, dispatch=mode, capacity=capacity)  # [N, D]
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = shared * self.shared_expert_gate(flat).sigmoid()
            y = y + shared
        return MoEOutput(y.view(shape), logits, dropped)
