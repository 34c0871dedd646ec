"""Absolute position embeddings: learned (GPT-2, BERT) and fixed sinusoidal (Vaswani et al., 2017).

Shape notation: ``B`` batch, ``S`` sequence, ``D`` model width, ``P`` positions.
Both modules map position ids ``[B, S]`` to embeddings ``[B, S, D]`` that the model
adds to its token embeddings.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnlab.functional.positions import sinusoidal_table

__all__ = ["LearnedPositionalEmbedding", "SinusoidalPositionalEmbedding"]


def _check_positions(positions: Tensor, limit: int) -> None:
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
