"""DeltaNet and Gated DeltaNet mixers, in Qwen3-Next's layout.

Yang et al. (2024), "Parallelizing linear transformers with the delta rule over sequence
length" (DeltaNet with a short convolution and L2-normalised keys); Yang et al. (2025),
"Gated delta networks" (the decay), as Qwen3-Next's ``Qwen3NextGatedDeltaNet`` builds it:

    q, k, v, z = in_proj_qkvz(x)         (grouped per key head)
    b, a       = in_proj_ba(x)
    q, k, v    = silu(causal_conv(q, k, v));  q, k L2-normalised
    beta = sigmoid(b);   g = -exp(A_log) softplus(a + dt_bias)     (no g: DeltaNet)
    o = delta_rule(q, k, v, beta, g);   y = out_proj(rmsnorm(o) * silu(z))

Shape notation: ``B`` batch, ``L`` tokens, ``D`` width, ``H_k``/``H_v`` key/value heads
(each key head serves ``H_v / H_k`` value heads), ``K``/``V`` key/value head dims.
Parameter names follow transformers' module, so checkpoints map one to one.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.cache.linear_state import DeltaNetState
from attnlab.functional._checks import check_positive_int
from attnlab.functional.delta_rule import delta_rule_chunked, delta_rule_step
from attnlab.modules.linear import make_linear
from attnlab.modules.mamba import causal_conv

__all__ = ["GatedDeltaNet", "NormGate", "l2_normalize"]


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (fla's and Qwen3-Next's ``l2norm``)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class NormGate(nn.Module):
    """``weight * rmsnorm(y) * silu(z)`` over the last dim (norm first, then the gate).

    Args:
        dim: normalised width (a head's value dim).
        eps: added to the mean square.
    """

    def __init__(self, dim: int, *, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, y: Tensor, z: Tensor) -> Tensor:
        """``y, z [..., dim] -> [..., dim]``, computed in float32."""
        h = y.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(y.dtype)
        return (h * F.silu(z.float())).to(y.dtype)


class GatedDeltaNet(nn.Module):
    """The (Gated) DeltaNet mixer.

    Args:
        hidden_size: ``D``.
        num_k_heads: ``H_k``.
        num_v_heads: ``H_v`` (a multiple of ``H_k``).
        head_k_dim: ``K``.
        head_v_dim: ``V``.
        conv_kernel: width of the causal depthwise convolution over ``q, k, v``.
        decay: the gate ``g`` (Gated DeltaNet); False is DeltaNet (``S`` never decays).
        norm_eps: epsilon of the output norm.
        chunk_size: tokens per chunk of the chunked form (prefill and training).
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int = 4,
        decay: bool = True,
        norm_eps: float = 1e-6,
        chunk_size: int = 64,
    ) -> None:
        super().__init__()
        for name, value in (
            ("hidden_size", hidden_size),
            ("num_k_heads", num_k_heads),
            ("num_v_heads", num_v_heads),
            ("head_k_dim", head_k_dim),
            ("head_v_dim", head_v_dim),
            ("conv_kernel", conv_kernel),
            ("chunk_size", chunk_size),
        ):
            check_positive_int(name, value)
        if num_v_heads % num_k_heads:
            raise ValueError(
                f"num_v_heads ({num_v_heads}) must be a multiple of num_k_heads ({num_k_heads})"
            )
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.decay, self.chunk_size = decay, chunk_size
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            conv_kernel,
            groups=self.conv_dim,
            bias=False,
            padding=conv_kernel - 1,
        )
        self.in_proj_qkvz = make_linear(
            hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False
        )
        self.in_proj_ba = make_linear(hidden_size, num_v_heads * (2 if decay else 1), bias=False)
        if decay:
            # flash-linear-attention's initialisation, which Yang et al. (2025) trained with
            # (Mamba-2's): A ~ U(0, 16), softplus(dt_bias) log-uniform in [1e-3, 0.1], so
            # the decays start between exp(-1.6) and 1 per token. (transformers' Qwen3-Next
            # starts dt_bias at 1, decays of exp(-1.3 A): a state that forgets within a
            # token or two, which left two-layer models on MQAR at chance; checkpoints
            # overwrite both.)
            dt = torch.exp(torch.rand(num_v_heads) * math.log(100.0) + math.log(1e-3))
            dt = dt.clamp(min=1e-4)
            self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1
            self.A_log = nn.Parameter(torch.log(torch.empty(num_v_heads).uniform_(0, 16)))
        self.norm = NormGate(head_v_dim, eps=norm_eps)
        self.out_proj = make_linear(self.value_dim, hidden_size, bias=False)

    def new_state(self) -> DeltaNetState:
        return DeltaNetState()

    def _split(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None]:
        """``q, k [B, L, H_k K]``, ``v, z [B, L, H_v, V]``, ``b, a [B, L, H_v]`` (Qwen3-Next's grouping)."""
        bsz, l, _ = x.shape
        hk, r, dk, dv = (
            self.num_k_heads,
            self.num_v_heads // self.num_k_heads,
            self.head_k_dim,
            self.head_v_dim,
        )
        qkvz = self.in_proj_qkvz(x).view(bsz, l, hk, 2 * dk + 2 * r * dv)
        q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=-1)
        ba = self.in_proj_ba(x).view(bsz, l, hk, -1)
        b, a = (ba[..., :r], ba[..., r:]) if self.decay else (ba, None)
        v = v.reshape(bsz, l, -1, dv)
        z = z.reshape(bsz, l, -1, dv)
        flat = (q.reshape(bsz, l, -1), k.reshape(bsz, l, -1))
        return *flat, v, z, b.reshape(bsz, l, -1), None if a is None else a.reshape(bsz, l, -1)

    def forward(
        self, x: Tensor, *, mask: Tensor | None = None, state: DeltaNetState | None = None
    ) -> Tensor:
        """``x [B, L, D] -> [B, L, D]``; continues from and updates ``state`` when given."""
        bsz, l, _ = x.shape
        q, k, v, z, b, a = self._split(x)
        mixed = torch.cat((q, k, v.reshape(bsz, l, -1)), dim=-1)  # [B, L, conv_dim]
        mixed = causal_conv(mixed, self.conv1d, state, mask)
        q, k, v_ = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        r = self.num_v_heads // self.num_k_heads
        # [B, L, H, d] -> [B, H, L, d]; each key head serves r consecutive value heads
        q = (
            l2_normalize(q.view(bsz, l, -1, self.head_k_dim))
            .repeat_interleave(r, 2)
            .transpose(1, 2)
        )
        k = (
            l2_normalize(k.view(bsz, l, -1, self.head_k_dim))
            .repeat_interleave(r, 2)
            .transpose(1, 2)
        )
        v = v_.reshape(bsz, l, -1, self.head_v_dim).transpose(1, 2)
        beta = b.sigmoid().transpose(1, 2)  # [B, H_v, L]
        g = None
        if a is not None:
            g = (-self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)).to(x.dtype)
            g = g.transpose(1, 2)
        init = state.ssm if state is not None else None
        if l == 1 and init is not None:
            step_mask = mask[:, 0].to(beta.dtype)[:, None] if mask is not None else 1.0
            o, s = delta_rule_step(
                q[:, :, 0],
                k[:, :, 0],
                v[:, :, 0],
                beta[:, :, 0] * step_mask,
                init,
                g=None if g is None else g[:, :, 0] * step_mask,
            )
            o = o[:, :, None]
        else:
            o, s = delta_rule_chunked(
                q,
                k,
                v,
                beta,
                g=g,
                state=init,
                mask=mask,
                chunk_size=min(self.chunk_size, max(l, 1)),
            )
        if state is not None:
            state.write_ssm(s, l)
        o = self.norm(o.transpose(1, 2), z)  # [B, L, H_v, V]
        return self.out_proj(o.reshape(bsz, l, self.value_dim))
