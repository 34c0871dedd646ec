"""Position-wise feed-forward network: ``dropout(fc_out(act(fc_in(x))))``.

Shape notation: ``B`` batch, ``S`` sequence, ``D`` model width, ``F`` hidden width.
"""

from __future__ import annotations

from torch import Tensor, nn

from attnlab.functional._checks import check_positive_int, check_probability
from attnlab.modules.activations import get_activation
from attnlab.modules.fused_linear import FusedProjection
from attnlab.modules.linear import make_linear

__all__ = ["FeedForward", "GatedFeedForward"]


class FeedForward(nn.Module):
    """Two linear layers with an activation between them (Vaswani et al., 2017, sec. 3.3).

    Args:
        embed_dim: model width ``D``.
        hidden_dim: inner width ``F`` (BERT: ``4 * D``).
        activation: activation name (``"gelu"`` is the exact erf GELU BERT uses).
        dropout: dropout after the second linear layer (training only).
        bias: biases on both linear layers.
    """

    def __init__(
        self,
        *,
        embed_dim: int,
        hidden_dim: int,
        activation: str = "gelu",
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        check_positive_int("embed_dim", embed_dim)
        check_positive_int("hidden_dim", hidden_dim)
        check_probability("dropout", dropout)
        self.activation_name = activation
        self.act = get_activation(activation)
        self.fc_in = make_linear(embed_dim, hidden_dim, bias=bias)
        self.fc_out = make_linear(hidden_dim, embed_dim, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def extra_repr(self) -> str:
        return f"activation={self.activation_name!r}"

    def forward(self, x: Tensor) -> Tensor:
        """``[B, S, D] -> [B, S, D]``."""
        out = self.fc_out(self.act(self.fc_in(x)))
        return self.dropout(out) if self.training and self.dropout.p > 0 else out


class GatedFeedForward(nn.Module):
    """Gated linear unit feed-forward: ``down(act(gate(x)) * up(x))`` (Shazeer, 2020).

    With ``activation="silu"`` this is SwiGLU (Llama, Mistral); with ``"gelu_new"`` it is
    T5 v1.1's gated GELU.

    Args:
        embed_dim: model width ``D``.
        hidden_dim: inner width ``F``.
        activation: activation of the gate.
        dropout: dropout after the down projection (training only).
        bias: biases on the three linear layers.
    """

    def __init__(
        self,
        *,
        embed_dim: int,
        hidden_dim: int,
        activation: str = "silu",
        dropout: float = 0.0,
        bias: bool = False,
    ) -> None:
        super().__init__()
        check_positive_int("embed_dim", embed_dim)
        check_positive_int("hidden_dim", hidden_dim)
        check_probability("dropout", dropout)
        self.activation_name = activation
        self.act = get_activation(activation)
        self.gate_proj = make_linear(embed_dim, hidden_dim, bias=bias)
        self.up_proj = make_linear(embed_dim, hidden_dim, bias=bias)
        self.down_proj = make_linear(hidden_dim, embed_dim, bias=bias)
        self.dropout = nn.Dropout(dropout)
        #: gate/up as one matmul (inference-only derived state, not a submodule:
        #: :func:`attnlab.models.fuse.fuse_projections`), or None
        self.fused_gate_up: FusedProjection | None = None

    def extra_repr(self) -> str:
        return f"activation={self.activation_name!r}"

    def forward(self, x: Tensor) -> Tensor:
        """``[B, S, D] -> [B, S, D]``."""
        if self.fused_gate_up is not None:
            gate, up = self.fused_gate_up(x)  # views of one [B, S, 2F]
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)  # [B, S, F] each
        out = self.down_proj(self.act(gate) * up)
        return self.dropout(out) if self.training and self.dropout.p > 0 else out
