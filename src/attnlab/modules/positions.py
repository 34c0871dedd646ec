"""Every position component a model holds, in one module.

Shape notation: ``B`` batch, ``H`` heads, ``L`` queries, ``S`` sequence/keys, ``D``
model width, ``P`` positions, ``h_d`` head dim.

The math lives in :mod:`attnlab.functional.positions` (reference functions: sinusoidal
tables, RoPE and its scalings, ALiBi slopes, T5 buckets); these modules own the buffers
and parameters and call it:

* added to the token embeddings: :class:`LearnedPositionalEmbedding` (GPT-2, BERT) and
  :class:`SinusoidalPositionalEmbedding` (Vaswani et al., 2017);
* applied to queries and keys: :class:`RotaryEmbedding` (RoPE, Su et al., 2021, with
  linear, dynamic NTK, YaRN and Llama 3 scalings);
* applied to the scores, tile by tile, as a score modifier evaluated on the call's
  positions (:mod:`attnlab.functional.score_mods`): ALiBi needs no module (its slopes
  are fixed: ``score_mods.alibi(num_heads)``, Press et al., 2022) and T5's learned
  bias is :class:`T5RelativePositionBias`, whose :meth:`~T5RelativePositionBias.score_mod`
  reads its table by reference so the gradient reaches it (Raffel et al., 2020).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.functional.positions import (
    RopeConvention,
    apply_rope,
    rope_angles,
    rope_inv_freq,
    sinusoidal_table,
)
from attnlab.functional.score_mods import T5Bias, t5_bias

__all__ = [
    "LearnedPositionalEmbedding",
    "RotaryEmbedding",
    "SinusoidalPositionalEmbedding",
    "T5RelativePositionBias",
]


def _check_positions(positions: Tensor, limit: int) -> None:
    if torch.compiler.is_compiling():
        return  # validated where the user entered (a compiled step has no host syncs)
    if positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise TypeError(f"position ids must be integers, got {positions.dtype}")
    if positions.numel() and (int(positions.max()) >= limit or int(positions.min()) < 0):
        raise ValueError(
            f"position ids must lie in [0, {limit}) (the model's max_position_embeddings), got "
            f"range [{int(positions.min())}, {int(positions.max())}]"
        )


class LearnedPositionalEmbedding(nn.Module):
    """One learned vector per position (Gehring et al., 2017; GPT-2).

    Args:
        num_positions: the maximum number of positions ``P``.
        embed_dim: width ``D``.
    """

    def __init__(self, *, num_positions: int, embed_dim: int) -> None:
        super().__init__()
        self.num_positions = num_positions
        self.weight = nn.Parameter(torch.empty(num_positions, embed_dim))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, positions: Tensor) -> Tensor:
        """``[B, S]`` position ids -> ``[B, S, D]``; positions ``>= P`` raise ``ValueError``."""
        _check_positions(positions, self.num_positions)
        return nn.functional.embedding(positions, self.weight)


class SinusoidalPositionalEmbedding(nn.Module):
    """The original Transformer's fixed encodings (Vaswani et al., 2017, sec. 3.5).

    Args:
        num_positions: how many positions to tabulate.
        embed_dim: width ``D`` (even).
        base: the wavelength base (10000).
    """

    table: Tensor

    def __init__(self, *, num_positions: int, embed_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        self.num_positions = num_positions
        self.register_buffer(
            "table", sinusoidal_table(num_positions, embed_dim, base=base), persistent=False
        )

    def forward(self, positions: Tensor) -> Tensor:
        """``[B, S]`` position ids -> ``[B, S, D]``."""
        _check_positions(positions, self.num_positions)
        return self.table[positions]


class RotaryEmbedding(nn.Module):
    """Rotary embeddings with optional scaling (linear, dynamic NTK, YaRN, Llama 3, LongRoPE).

    Args:
        dim: number of rotated features per head (the head dim, or less for partial RoPE).
        base: ``rope_theta``.
        scaling: transformers-style ``rope_parameters`` (``{"rope_type": "yarn", "factor": 4,
            ...}``), or None; see :func:`attnlab.functional.positions.rope_inv_freq`.
        max_position_embeddings: the model's maximum positions (dynamic NTK scales beyond it).
        convention: ``"half"`` (Llama, GPT-NeoX) or ``"interleaved"`` (GPT-J, the paper).

    Dynamic NTK recomputes the frequencies from the largest position of each call
    (``max(positions) + 1``), as transformers does while it generates, and LongRoPE
    switches from its short to its long factors on the same length; other types are
    fixed at construction.

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
        pos = positions if positions.dim() == 2 else positions.unsqueeze(0)  # [B, S]
        if torch.compiler.is_compiling():  # no memo, no host sync inside a compiled step
            return rope_angles(pos, self.inv_freq, attention_factor=self.attention_factor)
        memo = self._memo
        if memo is not None and memo[0] is positions:
            return memo[1], memo[2]
        inv_freq = self.inv_freq
        if self.rope_type == "longrope" and positions.numel():
            # transformers' switch: the long factors once a position passes the original length
            seq_len = int(positions.max()) + 1
            if seq_len > int((self.scaling or {})["original_max_position_embeddings"]):
                inv_freq, _ = rope_inv_freq(
                    self.dim,
                    base=self.base,
                    scaling=self.scaling,
                    max_position_embeddings=self.max_position_embeddings,
                    seq_len=seq_len,
                )
                inv_freq = inv_freq.to(positions.device)
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


class T5RelativePositionBias(nn.Module):
    """T5's learned, bucketed relative position bias (Raffel et al., 2020, sec. 2.1).

    One scalar per (bucket, head), shared by all layers of a stack. The table is the
    weight of ``relative_attention_bias`` (an ``nn.Embedding``, transformers' key name).
    Attention layers do not receive a dense bias: the model attaches
    :meth:`score_mod` to its mask pattern and every backend applies it on the call's
    positions; backends that apply it tile by tile also return the table's gradient.

    Args:
        num_heads: heads ``H``.
        num_buckets: number of relative-position buckets.
        max_distance: distance beyond which positions share a bucket.
        bidirectional: True for the encoder, False for causal decoder self-attention.
    """

    def __init__(
        self,
        *,
        num_heads: int,
        num_buckets: int = 32,
        max_distance: int = 128,
        bidirectional: bool = True,
    ) -> None:
        super().__init__()
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.bidirectional = bidirectional
        self.relative_attention_bias = nn.Embedding(num_buckets, num_heads)

    def extra_repr(self) -> str:
        return (
            f"num_buckets={self.num_buckets}, max_distance={self.max_distance}, "
            f"bidirectional={self.bidirectional}"
        )

    def score_mod(self) -> T5Bias:
        """The score modifier ``score + table[bucket(k - q), h]`` over this module's table."""
        return t5_bias(
            self.relative_attention_bias.weight,
            bidirectional=self.bidirectional,
            max_distance=self.max_distance,
        )
