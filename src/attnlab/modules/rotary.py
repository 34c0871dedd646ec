"""Rotary position embedding (RoPE) as a component of the attention module (Su et al., 2021).

Shape notation: ``B`` batch, ``H`` heads, ``S`` sequence, ``h_d`` head dim.

:class:`RotaryEmbedding` rotates queries and keys by angles proportional to their
positions, so that ``<R(m) q, R(n) k>`` depends only on ``n - m``. The attention
module calls it on ``q`` and on the new ``k`` before caching them. One instance is
shared by all layers of a model; it keeps the cos/sin of the last positions it saw,
so a forward pass computes them once, not once per layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from attnlab.functional.positions import RopeConvention, apply_rope, rope_angles, rope_inv_freq

__all__ = ["RotaryEmbedding"]


class RotaryEmbedding(nn.Module):
    """Rotary embeddings with optional scaling (linear, dynamic NTK, YaRN, Llama 3).

    Args:
        dim: number of rotated features per head (the head dim, or less for partial RoPE).
        base: ``rope_theta``.
        scaling: transformers-style ``rope_parameters`` (``{"rope_type": "yarn", "factor": 4,
            ...}``), or None; see :func:`attnlab.functional.positions.rope_inv_freq`.
        max_position_embeddings: the model's maximum positions (dynamic NTK scales beyond it).
        convention: ``"half"`` (Llama, GPT-NeoX) or ``"interleaved"`` (GPT-J, the paper).

    Dynamic NTK recomputes the frequencies from the largest position of each call
    (``max(positions) + 1``), as transformers does while it generates; other types
    are fixed at construction.

    Raises:
        ValueError: unknown scaling type or convention, odd ``dim``.
    """

    inv_freq: Tensor

    def __init__(
        self,
        *,
        dim: int,
        base: float = 10000.0,
        scaling: Mapping[str, Any] | None = None,
        max_position_embeddings: int = 2048,
        convention: RopeConvention = "half",
    ) -> None:
        super().__init__()
        if convention not in ("half", "interleaved"):
            raise ValueError(f"RoPE convention must be 'half' or 'interleaved', got {convention!r}")
        self.dim = dim
        self.base = base
        self.scaling = dict(scaling) if scaling else None
        self.rope_type = (self.scaling or {}).get("rope_type", "default")
        self.max_position_embeddings = max_position_embeddings
        self.convention: RopeConvention = convention
        inv_freq, self.attention_factor = rope_inv_freq(
            dim, base=base, scaling=self.scaling, max_position_embeddings=max_position_embeddings
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._memo: tuple[Tensor, Tensor, Tensor] | None = None

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}, rope_type={self.rope_type!r}, convention={self.convention!r}"

    def angles(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """``(cos, sin)`` float32 ``[B, S, dim/2]`` for position ids ``[B, S]`` (or ``[S]``)."""
        memo = self._memo
        if memo is not None and memo[0] is positions:
            return memo[1], memo[2]
        inv_freq = self.inv_freq
        if self.rope_type == "dynamic" and positions.numel():
            seq_len = int(positions.max()) + 1
            if seq_len > self.max_position_embeddings:
                inv_freq, _ = rope_inv_freq(
                    self.dim,
                    base=self.base,
                    scaling=self.scaling,
                    max_position_embeddings=self.max_position_embeddings,
                    seq_len=seq_len,
                )
                inv_freq = inv_freq.to(positions.device)
        pos = positions if positions.dim() == 2 else positions.unsqueeze(0)  # [B, S]
        cos, sin = rope_angles(pos, inv_freq, attention_factor=self.attention_factor)
        self._memo = (positions, cos, sin)
        return cos, sin

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotate ``x [B, H, S, h_d]`` at position ids ``positions [B, S]`` (or ``[S]``)."""
        cos, sin = self.angles(positions)
        return apply_rope(x, cos, sin, convention=self.convention)

    def reset(self) -> None:
        """Forget the memoised cos/sin (they are recomputed on the next call)."""
        self._memo = None

    def _apply(self, fn: Any, recurse: bool = True) -> RotaryEmbedding:
        # Moving the model to half precision must not round the frequencies: keep float32.
        self._memo = None
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(device=self.inv_freq.device)
        return self
