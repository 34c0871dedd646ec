"""The RWKV-7 ("Goose") time-mix mixer.

Peng et al. (2025), "RWKV-7 'Goose' with expressive dynamic state evolution", section 4,
as flash-linear-attention's ``RWKV7Attention`` builds it (its parameter names):

    x_* = x + (shift(x) - x) mu_*                        (token shift, one lerp per branch)
    r, k, v = r_proj(x_r), k_proj(x_k), v_proj(x_v)
    gk = -e^{-1/2} sigmoid(w_lora(x_w))                   (log decay in (-0.607, 0))
    a = sigmoid(a_lora(x_a));   g = g_lora(x_g)
    kappa = l2norm(k k_k);      k = k (1 + (a - 1) k_a)
    o = rwkv7(r, k, v, -kappa, kappa a, gk)               (:mod:`attnlab.functional.rwkv7`)
    y = o_proj((group_norm(o) + (r . k . r_k) v) g)

The value residual (the paper's section 4, "value residual learning"): the first RWKV-7
layer's values ``v_first`` are handed to every later layer, which mixes them into its own
by a learnt per-channel gate before the state update,

    v = v + (v_first - v) sigmoid(v_lora(x_v))            (``v_lora``: rank 32, bias 1)

(``value_residual="first"`` hands them on, ``"mix"`` mixes them in, ``"none"`` is off;
:mod:`attnlab.models.linear_mixers` passes them through the forward's plan). The channel
mix is the decoder's feed-forward.

Shape notation: ``B`` batch, ``L`` tokens, ``D`` width, ``H`` heads, ``K`` head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.cache.linear_state import RWKV7State
from attnlab.functional._checks import check_positive_int
from attnlab.functional.rwkv7 import rwkv7_chunked, rwkv7_step
from attnlab.modules.linear import make_linear

__all__ = ["RWKV7TimeMix"]


def _lora(
    d_in: int, rank: int, d_out: int, activation: nn.Module | None, bias: bool = True
) -> nn.Sequential:
    parts: list[nn.Module] = [make_linear(d_in, rank, bias=False)]
    if activation is not None:
        parts.append(activation)
    parts.append(make_linear(rank, d_out, bias=bias))
    return nn.Sequential(*parts)


VALUE_RESIDUAL = ("none", "first", "mix")


class RWKV7TimeMix(nn.Module):
    """RWKV-7's time mix.

    Args:
        hidden_size: ``D``.
        num_heads: ``H`` (``D`` divisible by it).
        decay_low_rank_dim, a_low_rank_dim, gate_low_rank_dim: the LoRA ranks
            (fla's defaults for small models: 64, 64, 128; capped at ``D``).
        chunk_size: tokens per chunk of the chunked form.
        value_residual: ``"first"`` (this layer's values are the ones later layers mix
            in: :meth:`forward` with ``return_values=True`` hands them out), ``"mix"``
            (takes ``v_first`` and mixes it in by a learnt gate), or ``"none"``.
        value_low_rank_dim: the value gate's LoRA rank (RWKV-7's 32; capped at ``D``).
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        decay_low_rank_dim: int = 64,
        a_low_rank_dim: int = 64,
        gate_low_rank_dim: int = 128,
        chunk_size: int = 64,
        value_residual: str = "none",
        value_low_rank_dim: int = 32,
    ) -> None:
        super().__init__()
        if value_residual not in VALUE_RESIDUAL:
            raise ValueError(
                f"value_residual must be one of {VALUE_RESIDUAL}, got {value_residual!r}"
            )
        check_positive_int("value_low_rank_dim", value_low_rank_dim)
        self.value_residual = value_residual
        for name, value in (
            ("hidden_size", hidden_size),
            ("num_heads", num_heads),
            ("chunk_size", chunk_size),
        ):
            check_positive_int(name, value)
        if hidden_size % num_heads:
            raise ValueError(
                f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})"
            )
        d = hidden_size
        self.num_heads, self.head_dim, self.chunk_size = num_heads, d // num_heads, chunk_size
        for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            setattr(self, name, nn.Parameter(torch.rand(1, 1, d) * 0.5))
        self.k_k = nn.Parameter(torch.full((d,), 0.85))
        self.k_a = nn.Parameter(torch.ones(d))
        self.r_k = nn.Parameter(torch.randn(num_heads, self.head_dim) * 0.1)
        self.r_proj = make_linear(d, d, bias=False)
        self.k_proj = make_linear(d, d, bias=False)
        self.v_proj = make_linear(d, d, bias=False)
        self.o_proj = make_linear(d, d, bias=False)
        self.w_lora = _lora(d, min(decay_low_rank_dim, d), d, nn.Tanh())
        self.a_lora = _lora(d, min(a_low_rank_dim, d), d, None)
        self.g_lora = _lora(d, min(gate_low_rank_dim, d), d, nn.Sigmoid(), bias=False)
        self.g_norm = nn.GroupNorm(num_heads, d, eps=self.head_dim * 1e-5)
        if value_residual == "mix":
            # RWKV-7's init: the down projection zero, the bias 1 (a gate of sigmoid(1) = 0.73)
            self.v_lora = _lora(d, min(value_low_rank_dim, d), d, None)
            down, up = self.v_lora[0], self.v_lora[-1]
            assert isinstance(down, nn.Linear) and isinstance(up, nn.Linear)
            with torch.no_grad():
                down.weight.zero_()
                up.bias.fill_(1.0)

    def new_state(self) -> RWKV7State:
        return RWKV7State()

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        state: RWKV7State | None = None,
        v_first: Tensor | None = None,
        return_values: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """``x [B, L, D] -> [B, L, D]``; continues from and updates ``state`` when given.

        Args:
            v_first: ``[B, L, D]`` the first RWKV-7 layer's values for these tokens
                (required by a ``value_residual="mix"`` layer, refused by the others).
            return_values: also return this layer's values ``[B, L, D]`` (after the
                value residual), as ``(y, v)``.

        Raises:
            ValueError: ``v_first`` missing for a mixing layer, given to another, or of
                another shape.
        """
        b, l, d = x.shape
        if self.value_residual == "mix":
            if v_first is None or v_first.shape != x.shape:
                got = None if v_first is None else tuple(v_first.shape)
                raise ValueError(
                    f"this RWKV-7 layer mixes in the first layer's values: v_first must be "
                    f"{tuple(x.shape)} (batch, seq_len, hidden), got {got}"
                )
        elif v_first is not None:
            raise ValueError(
                f"v_first given to an RWKV-7 layer with value_residual={self.value_residual!r}"
                " (only 'mix' layers take it)"
            )
        h, dk = self.num_heads, self.head_dim
        if mask is not None:
            x = x * mask[..., None].to(x.dtype)  # padding reads as the zeros before a row
        prev = state.shift if state is not None and state.shift is not None else x.new_zeros((b, d))
        shifted = torch.cat((prev[:, None].to(x.dtype), x[:, :-1]), dim=1)
        delta = shifted - x
        xr, xw, xk, xv, xa, xg = (
            x + delta * getattr(self, n) for n in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")
        )
        r, k, v = self.r_proj(xr), self.k_proj(xk), self.v_proj(xv)
        if v_first is not None:
            v = torch.lerp(v, v_first.to(v.dtype), torch.sigmoid(self.v_lora(xv)))
        gk = -math.exp(-0.5) * torch.sigmoid(self.w_lora(xw))
        a = torch.sigmoid(self.a_lora(xa))
        g = self.g_lora(xg)
        kappa = F.normalize((k * self.k_k).view(b, l, h, dk), dim=-1, eps=1e-12)
        k = k * (1 + (a - 1) * self.k_a)

        def heads(t: Tensor) -> Tensor:
            return t.reshape(b, l, h, dk).transpose(1, 2)  # [B, H, L, K]

        rh, kh, vh, ah, gh = heads(r), heads(k), heads(v), heads(a), heads(gk)
        kap = kappa.transpose(1, 2)
        init = state.ssm if state is not None else None
        if l == 1 and init is not None:
            m = mask[:, 0].to(x.dtype)[:, None, None] if mask is not None else 1.0
            o, s = rwkv7_step(
                rh[:, :, 0],
                kh[:, :, 0] * m,
                vh[:, :, 0],
                -kap[:, :, 0],
                kap[:, :, 0] * ah[:, :, 0] * m,
                gh[:, :, 0] * m,
                init,
            )
            o = o[:, :, None]
        else:
            o, s = rwkv7_chunked(
                rh,
                kh,
                vh,
                -kap,
                kap * ah,
                gh,
                state=init,
                mask=mask,
                chunk_size=min(self.chunk_size, max(l, 1)),
            )
        if state is not None:
            last = x[:, -1]
            if mask is not None:  # a padded last step keeps the previous input
                keep = mask[:, -1].to(x.dtype)[:, None]
                last = keep * last + (1 - keep) * prev.to(x.dtype)
            state.write(last, s, l)
        o = self.g_norm(o.transpose(1, 2).reshape(b * l, d)).view(b, l, d)
        bonus = (r.view(b, l, h, dk) * k.view(b, l, h, dk) * self.r_k).sum(-1, keepdim=True)
        o = o + (bonus * v.view(b, l, h, dk)).view(b, l, d)
        y = self.o_proj(o * g)
        return (y, v) if return_values else y
