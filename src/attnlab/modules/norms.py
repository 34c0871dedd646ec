"""Root-mean-square layer norm (Zhang & Sennrich, 2019), as Llama and T5 use it.

Shape notation: ``...`` any leading dims, ``D`` normalised width, ``H`` heads, ``h_d``
head dim.

* :class:`RMSNorm`: ``w * x / rms(x)`` (Llama, T5, Qwen);
* :class:`OffsetRMSNorm`: ``(1 + w) * x / rms(x)``, the weight stored as an offset from
  one and the product taken in float32 (Gemma, Gemma 2 and 3);
* :class:`PerHeadNorm`: any norm over each head's features of a ``[..., H * h_d]``
  projection (Qwen3's and Gemma 3's QK-norm, Dehghani et al., 2023).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["OffsetRMSNorm", "PerHeadNorm", "RMSNorm", "make_norm"]


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


class OffsetRMSNorm(nn.Module):
    """``(1 + weight) * x / sqrt(mean(x^2) + eps)``, in float32, cast back (Gemma).

    The weight starts at zero (the identity scale). Unlike :class:`RMSNorm`, the scale
    multiplies before the cast, as Gemma's reference does: in bfloat16 the two differ by
    a rounding.

    Args:
        dim: width ``D``.
        eps: added to the mean square.
    """

    def __init__(self, dim: int, *, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"

    def forward(self, x: Tensor) -> Tensor:
        """``[..., D] -> [..., D]``."""
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.to(torch.float32))).to(x.dtype)


class PerHeadNorm(nn.Module):
    """A norm over each head's ``h_d`` features of a ``[..., H * h_d]`` projection.

    Args:
        norm: the norm of one head (width ``h_d``), e.g. ``RMSNorm(h_d)``.
        head_dim: ``h_d``.
    """

    def __init__(self, *, norm: nn.Module, head_dim: int) -> None:
        super().__init__()
        self.norm = norm
        self.head_dim = head_dim

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}"

    def forward(self, x: Tensor) -> Tensor:
        """``[..., H * h_d] -> [..., H * h_d]``."""
        heads = x.unflatten(-1, (-1, self.head_dim))  # [..., H, h_d]
        out: Tensor = self.norm(heads)
        return out.flatten(-2)


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    """``"rmsnorm"`` -> :class:`RMSNorm`, ``"gemma_rmsnorm"`` -> :class:`OffsetRMSNorm`,
    ``"layernorm"`` -> ``nn.LayerNorm``."""
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    if kind == "gemma_rmsnorm":
        return OffsetRMSNorm(dim, eps=eps)
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps)
    raise ValueError(f"unknown norm {kind!r}; expected 'rmsnorm', 'gemma_rmsnorm' or 'layernorm'")
