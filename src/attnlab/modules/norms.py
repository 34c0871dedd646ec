"""Root-mean-square layer norm (Zhang & Sennrich, 2019), as Llama and T5 use it.

Shape notation: ``...`` any leading dims, ``D`` normalised width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, without centring or bias.

    Computed in float32 and cast back, as Llama and T5 do.

    Args:
        dim: width ``D``.
        eps: added to the mean square.
    """

    def __init__(self, dim: int, *, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"

    def forward(self, x: Tensor) -> Tensor:
        """``[..., D] -> [..., D]``."""
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # torch's fused kernel computes the same expression in one pass.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)
