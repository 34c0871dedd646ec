"""The gated linear attention (GLA) mixer.

Yang et al. (2024), "Gated linear attention transformers with hardware-efficient
training", section 4.4, as flash-linear-attention's ``GatedLinearAttention`` layer builds it:

    q, k, v = q_proj(x), k_proj(x), v_proj(x)           (keys: expand_k * D, values: expand_v * D)
    gk = logsigmoid(gk_proj(x)) / 16                      (low-rank: D -> 16 -> H K)
    o = gla(q, k, v, gk);   y = o_proj(rmsnorm(o) * silu(g_proj(x)))

Shape notation: ``B`` batch, ``L`` tokens, ``D`` width, ``H`` heads, ``K``/``V`` key/value
head dims. Parameter names follow fla's layer.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.cache.linear_state import GLAState
from attnlab.functional._checks import check_positive_int
from attnlab.functional.gla import gla_chunked, gla_step
from attnlab.modules.delta_net import NormGate

__all__ = ["GatedLinearAttention"]


class GatedLinearAttention(nn.Module):
    """The GLA mixer.

    Args:
        hidden_size: ``D``.
        num_heads: ``H``.
        key_dim: total key width ``H K`` (fla: ``expand_k * D`` with ``expand_k = 0.5``).
        value_dim: total value width ``H V`` (fla: ``D``).
        gate_low_rank_dim: inner width of the decay projection (16).
        gate_logit_normalizer: the decay's divisor (16: decays stay close to 1).
        norm_eps: epsilon of the output norm.
        chunk_size: tokens per chunk of the chunked form.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        key_dim: int,
        value_dim: int,
        gate_low_rank_dim: int = 16,
        gate_logit_normalizer: float = 16.0,
        norm_eps: float = 1e-5,
        chunk_size: int = 64,
    ) -> None:
        super().__init__()
        for name, value in (
            ("hidden_size", hidden_size),
            ("num_heads", num_heads),
            ("key_dim", key_dim),
            ("value_dim", value_dim),
            ("gate_low_rank_dim", gate_low_rank_dim),
            ("chunk_size", chunk_size),
        ):
            check_positive_int(name, value)
        for name, value in (("key_dim", key_dim), ("value_dim", value_dim)):
            if value % num_heads:
                raise ValueError(f"{name} ({value}) must be divisible by num_heads ({num_heads})")
        if not gate_logit_normalizer > 0:
            raise ValueError(f"gate_logit_normalizer must be positive, got {gate_logit_normalizer}")
        self.num_heads, self.key_dim, self.value_dim = num_heads, key_dim, value_dim
        self.head_k_dim, self.head_v_dim = key_dim // num_heads, value_dim // num_heads
        self.gate_logit_normalizer, self.chunk_size = float(gate_logit_normalizer), chunk_size
        self.q_proj = nn.Linear(hidden_size, key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, value_dim, bias=False)
        self.g_proj = nn.Linear(hidden_size, value_dim, bias=False)
        self.gk_proj = nn.Sequential(
            nn.Linear(hidden_size, gate_low_rank_dim, bias=False),
            nn.Linear(gate_low_rank_dim, key_dim, bias=True),
        )
        self.o_proj = nn.Linear(value_dim, hidden_size, bias=False)
        self.g_norm_swish_gate = NormGate(self.head_v_dim, eps=norm_eps)

    def new_state(self) -> GLAState:
        return GLAState()

    def forward(
        self, x: Tensor, *, mask: Tensor | None = None, state: GLAState | None = None
    ) -> Tensor:
        """``x [B, L, D] -> [B, L, D]``; continues from and updates ``state`` when given."""
        b, l, _ = x.shape
        h = self.num_heads

        def heads(t: Tensor, d: int) -> Tensor:
            return t.view(b, l, h, d).transpose(1, 2)  # [B, H, L, d]

        q = heads(self.q_proj(x), self.head_k_dim)
        k = heads(self.k_proj(x), self.head_k_dim)
        v = heads(self.v_proj(x), self.head_v_dim)
        gk = heads(F.logsigmoid(self.gk_proj(x)) / self.gate_logit_normalizer, self.head_k_dim)
        init = state.ssm if state is not None else None
        if l == 1 and init is not None:
            m = mask[:, 0].to(x.dtype)[:, None, None] if mask is not None else 1.0
            o, s = gla_step(q[:, :, 0], k[:, :, 0] * m, v[:, :, 0], gk[:, :, 0] * m, init)
            o = o[:, :, None]
        else:
            o, s = gla_chunked(
                q, k, v, gk, state=init, mask=mask, chunk_size=min(self.chunk_size, max(l, 1))
            )
        if state is not None:
            state.write_ssm(s, l)
        g = self.g_proj(x).view(b, l, h, self.head_v_dim)
        o = self.g_norm_swish_gate(o.transpose(1, 2), g)  # [B, L, H, V]
        return self.o_proj(o.reshape(b, l, self.value_dim))
