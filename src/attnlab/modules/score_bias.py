"""Score biases added to the attention logits: ALiBi and T5's relative position bias.

Shape notation: ``B`` batch, ``H`` heads, ``L`` query length, ``S`` key length.

A score-bias module is a component of :class:`~attnlab.modules.attention.MultiHeadAttention`:
called with query and key positions, it returns a float tensor ``[B or 1, H, L, S]``
that is added to ``q . k * scale`` before the softmax.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnlab.functional.positions import alibi_bias, alibi_slopes, t5_relative_position_bucket

__all__ = ["ALiBi", "T5RelativePositionBias"]


class ALiBi(nn.Module):
    """Attention with linear biases (Press et al., 2022): ``-slope_h * (i - j)``.

    Args:
        num_heads: number of query heads (the slopes follow the paper, including
            head counts that are not powers of two).
    """

    slopes: Tensor

    def __init__(self, *, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.register_buffer("slopes", alibi_slopes(num_heads), persistent=False)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}"

    def forward(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        """Bias ``[B, H, L, S]`` for positions ``[B, L]`` and ``[B, S]`` (or 1-D)."""
        return alibi_bias(self.slopes, q_positions, k_positions)


class T5RelativePositionBias(nn.Module):
    """T5's learned, bucketed relative position bias (Raffel et al., 2020, sec. 2.1).

    One scalar per (bucket, head), shared by all layers of a stack.

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

    def forward(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        """Bias ``[B, H, L, S]`` for positions ``[B, L]`` and ``[B, S]`` (or 1-D, then ``B = 1``)."""
        q = q_positions.reshape(-1, q_positions.shape[-1])  # [B, L]
        k = k_positions.reshape(-1, k_positions.shape[-1])  # [B, S]
        rel = k[:, None, :] - q[:, :, None]  # [B, L, S]
        bucket = t5_relative_position_bucket(
            rel,
            bidirectional=self.bidirectional,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )
        bias = self.relative_attention_bias(bucket)  # [B, L, S, H]
        return bias.permute(0, 3, 1, 2).to(torch.float32)  # [B, H, L, S]
