"""Attention with a sigmoid output gate (Qwen3-Next's full-attention layers).

Qiu et al. (2025), "Gated attention for large language models: non-linearity, sparsity,
and attention-sink-free": each head's output is multiplied by ``sigmoid(x W_g)`` before the
output projection, ``y = W_o (attention(x) * sigmoid(x W_g))``. Qwen3-Next stores
``W_g`` interleaved with the query projection (per head: the query rows, then the gate
rows); :mod:`attnlab.interop.qwen3_next` splits them.

Shape notation: ``B`` batch, ``L`` tokens, ``D`` width, ``H`` heads, ``h_d`` head dim.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnlab.modules.attention import MultiHeadAttention

__all__ = ["OutputGatedAttention"]


class OutputGatedAttention(nn.Module):
    """A :class:`MultiHeadAttention` whose output is gated before its output projection.

    Args:
        attention: the attention module; its own ``out_proj`` is moved here (it then
            returns the heads' concatenated outputs ``[B, L, H h_d]``).
        gate_proj: ``D -> H h_d``, the gate's projection.
    """

    def __init__(self, *, attention: MultiHeadAttention, gate_proj: nn.Linear) -> None:
        super().__init__()
        if gate_proj.out_features != attention.out_proj.in_features:
            raise ValueError(
                f"gate_proj gives {gate_proj.out_features} features, the attention's output "
                f"has {attention.out_proj.in_features}"
            )
        self.out_proj = attention.out_proj
        attention.out_proj = nn.Identity()  # type: ignore[assignment]
        self.attention = attention
        self.gate_proj = gate_proj

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        """``x [B, L, D] -> ([B, L, D], weights or None)``; the attention's arguments pass through."""
        out, weights = self.attention(x, *args, **kwargs)  # [B, L, H h_d]
        return self.out_proj(out * torch.sigmoid(self.gate_proj(x))), weights
