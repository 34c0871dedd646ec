"""RetNet's multi-scale retention (Sun et al., 2023, "Retentive network", section 2.2).

Per head ``h`` with its own decay ``gamma_h = 1 - 2^(-5-h)``, queries and keys rotated by
their position (the paper's ``Theta``; torchscale rotates interleaved pairs of channels),
keys scaled by ``1/sqrt(K)``:

    head_h = Retention(X, gamma_h)                    (:mod:`attnlab.functional.retention`)
    Y      = GroupNorm(concat(head_1 .. head_H))      (RMS norm per head, no affine)
    MSR(X) = (swish(X W_G) * Y) W_O

The group norm makes the output invariant to a per-head, per-token scale, which is why
implementations may rescale retention for numerical range; this module uses the paper's
equations unscaled. Parameter names follow torchscale's ``MultiScaleRetention``.

Shape notation: ``B`` batch, ``L`` tokens, ``D`` width, ``H`` heads, ``K = D / H`` key
dim, ``V`` value dim per head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.cache.recurrent import RetentionState
from attnlab.functional._checks import check_positive_int
from attnlab.functional.retention import (
    retention_chunkwise,
    retention_parallel,
    retention_recurrent,
)
from attnlab.modules.linear import make_linear

__all__ = ["MultiScaleRetention", "rotate_pairs"]


def rotate_pairs(x: Tensor, positions: Tensor, angle: Tensor) -> Tensor:
    """Rotate interleaved channel pairs of ``x [B, H, L, K]`` by ``positions [B|1, L] * angle [K]``."""
    theta = positions[:, None, :, None].to(x.dtype) * angle.to(x.dtype)  # [B|1, 1, L, K]
    x1, x2 = x[..., ::2], x[..., 1::2]
    rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
    return x * torch.cos(theta) + rotated * torch.sin(theta)


class MultiScaleRetention(nn.Module):
    """Multi-scale retention with gate and group norm.

    Args:
        embed_dim: ``D`` (also the query/key width).
        value_dim: total value width ``H * V`` (RetNet uses ``2 D``).
        num_heads: ``H``.
        norm_eps: epsilon of the per-head RMS norm.
        form: ``"chunkwise"`` (default, ``O(L T)`` memory) or ``"parallel"`` (``O(L^2)``)
            for multi-token inputs; single decoding steps use the recurrent form.
        chunk_size: ``T`` of the chunkwise form.
    """

    angle: Tensor
    gamma: Tensor

    def __init__(
        self,
        *,
        embed_dim: int,
        value_dim: int,
        num_heads: int,
        norm_eps: float = 1e-6,
        form: str = "chunkwise",
        chunk_size: int = 64,
    ) -> None:
        super().__init__()
        for name, v in (
            ("embed_dim", embed_dim),
            ("value_dim", value_dim),
            ("num_heads", num_heads),
            ("chunk_size", chunk_size),
        ):
            check_positive_int(name, v)
        if embed_dim % num_heads or value_dim % num_heads or (embed_dim // num_heads) % 2:
            raise ValueError(
                f"embed_dim ({embed_dim}) and value_dim ({value_dim}) must be divisible by "
                f"num_heads ({num_heads}), with an even key dim per head"
            )
        if form not in ("chunkwise", "parallel"):
            raise ValueError(f"form must be 'chunkwise' or 'parallel', got {form!r}")
        self.num_heads, self.key_dim = num_heads, embed_dim // num_heads
        self.head_dim = value_dim // num_heads
        self.norm_eps = norm_eps
        self.form = form
        self.chunk_size = chunk_size
        self.q_proj = make_linear(embed_dim, embed_dim, bias=False)
        self.k_proj = make_linear(embed_dim, embed_dim, bias=False)
        self.v_proj = make_linear(embed_dim, value_dim, bias=False)
        self.g_proj = make_linear(embed_dim, value_dim, bias=False)
        self.out_proj = make_linear(value_dim, embed_dim, bias=False)
        angle = 1.0 / (10000 ** torch.linspace(0, 1, self.key_dim // 2))
        self.register_buffer("angle", angle.repeat_interleave(2), persistent=False)
        gamma = 1 - 2.0 ** (-5 - torch.arange(num_heads, dtype=torch.float32))
        self.register_buffer("gamma", gamma, persistent=False)

    def new_state(self) -> RetentionState:
        return RetentionState()

    def forward(
        self,
        x: Tensor,
        *,
        positions: Tensor,
        mask: Tensor | None = None,
        state: RetentionState | None = None,
    ) -> Tensor:
        """``x [B, L, D] -> [B, L, D]``.

        Args:
            x: normalised input.
            positions: ``[B|1, L]`` each token's position in its row (0 at the first real token).
            mask: ``[B, L]`` 1 = token, 0 = padding.
            state: continue from and update this state.
        """
        b, l, _ = x.shape
        h = self.num_heads
        q = self.q_proj(x).view(b, l, h, self.key_dim).transpose(1, 2)  # [B, H, L, K]
        k = (self.k_proj(x) * self.key_dim**-0.5).view(b, l, h, self.key_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, l, h, self.head_dim).transpose(1, 2)  # [B, H, L, V]
        q, k = rotate_pairs(q, positions, self.angle), rotate_pairs(k, positions, self.angle)
        gamma = self.gamma.to(x.dtype)
        prev = state.state if state is not None else None
        if l == 1 and state is not None:
            o, s = retention_recurrent(q, k, v, gamma, state=prev, mask=mask)
        elif self.form == "parallel":
            o, s = retention_parallel(q, k, v, gamma, state=prev, mask=mask)
        else:
            o, s = retention_chunkwise(
                q, k, v, gamma, state=prev, mask=mask, chunk_size=min(self.chunk_size, l)
            )
        if state is not None:
            state.write(s, l)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm_eps)  # group norm
        o = o.transpose(1, 2).reshape(b, l, h * self.head_dim)  # [B, L, H V]
        return self.out_proj(F.silu(self.g_proj(x)) * o)
