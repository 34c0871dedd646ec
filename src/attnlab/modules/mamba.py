"""Mamba and Mamba-2 mixers: projection, causal depthwise convolution, selective scan, gate.

Gu & Dao (2023), "Mamba: linear-time sequence modeling with selective state spaces"
(figure 3, the Mamba block); Dao & Gu (2024), "Transformers are SSMs" (the Mamba-2 block,
with a scalar ``A`` per head, ``B``/``C`` produced alongside ``x`` and a gated RMSNorm).

Shape notation: ``B`` batch, ``L`` tokens, ``D`` model width, ``E`` inner width
(``expand * D``), ``N`` state size, ``R`` rank of the step-size projection, ``H`` heads,
``P`` head dim, ``G`` groups of ``B``/``C``, ``K`` convolution width.

A mixer maps ``x [B, L, D]`` to ``[B, L, D]``. With a state (:class:`MambaState`) it
continues from the tokens before and updates the state; ``mask [B, L]`` (1 token, 0
padding) makes padded steps no-ops (the convolution reads zeros, the scan skips them).
Parameter names follow transformers' ``MambaMixer``/``Mamba2Mixer`` so checkpoints map
one to one.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.cache.recurrent import Mamba2State, MambaState
from attnlab.functional._checks import check_positive_int
from attnlab.functional.selective_scan import selective_scan_chunked, selective_scan_reference
from attnlab.functional.ssd import ssd_chunked, ssd_reference
from attnlab.modules.linear import make_linear

__all__ = ["GatedRMSNorm", "Mamba2Mixer", "MambaMixer", "causal_conv"]


def causal_conv(
    x: Tensor, conv: nn.Conv1d, state: MambaState | None, mask: Tensor | None
) -> Tensor:
    """Depthwise causal convolution of ``x [B, L, C]`` (zeros or the state before it), then SiLU.

    Padding tokens (``mask == 0``) are read as zeros, like the zeros before a sequence.
    """
    if mask is not None:
        x = x * mask[..., None].to(x.dtype)
    k = conv.kernel_size[0]
    window = (
        state.conv_window(x, k) if state is not None else F.pad(x, (0, 0, k - 1, 0))
    )  # [B, K-1+L, C]
    y = F.conv1d(window.transpose(1, 2), conv.weight, conv.bias, groups=conv.groups)  # [B, C, L]
    return F.silu(y.transpose(1, 2))


def _init_dt_bias(n: int, dt_min: float, dt_max: float) -> Tensor:
    """Step sizes log-uniform in ``[dt_min, dt_max]``, stored as softplus's inverse (Mamba's init)."""
    dt = torch.exp(torch.rand(n) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = dt.clamp(min=1e-4)
    return dt + torch.log(-torch.expm1(-dt))


class MambaMixer(nn.Module):
    """The Mamba (S6) mixer.

    Args:
        hidden_size: ``D``.
        intermediate_size: ``E`` (Mamba uses ``2 D``).
        state_size: ``N``.
        conv_kernel: ``K``.
        dt_rank: ``R`` (Mamba uses ``ceil(D / 16)``).
        conv_bias: a bias in the convolution.
        bias: biases in the input/output projections.
        chunk_size: tokens per chunk of the chunked scan (prefill and training).
        dt_norm: a norm applied to the step-size projection's input ``[B, L, R]``, or None.
        b_norm: a norm applied to ``B [B, L, N]``, or None.
        c_norm: a norm applied to ``C [B, L, N]``, or None. Jamba (Lieber et al., 2024)
            puts an RMSNorm on each of the three; plain Mamba has none.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        intermediate_size: int,
        state_size: int = 16,
        conv_kernel: int = 4,
        dt_rank: int,
        conv_bias: bool = True,
        bias: bool = False,
        chunk_size: int = 64,
        dt_norm: nn.Module | None = None,
        b_norm: nn.Module | None = None,
        c_norm: nn.Module | None = None,
    ) -> None:
        super().__init__()
        for name, v in (
            ("hidden_size", hidden_size),
            ("intermediate_size", intermediate_size),
            ("state_size", state_size),
            ("conv_kernel", conv_kernel),
            ("dt_rank", dt_rank),
            ("chunk_size", chunk_size),
        ):
            check_positive_int(name, v)
        e, n = intermediate_size, state_size
        self.intermediate_size, self.state_size, self.dt_rank = e, n, dt_rank
        self.chunk_size = chunk_size
        self.in_proj = make_linear(hidden_size, 2 * e, bias=bias)
        self.conv1d = nn.Conv1d(
            e, e, conv_kernel, groups=e, bias=conv_bias, padding=conv_kernel - 1
        )
        self.x_proj = make_linear(e, dt_rank + 2 * n, bias=False)
        self.dt_proj = make_linear(dt_rank, e, bias=True)
        self.A_log = nn.Parameter(
            torch.log(torch.arange(1, n + 1, dtype=torch.float32)).repeat(e, 1)
        )
        self.D = nn.Parameter(torch.ones(e))
        self.out_proj = make_linear(e, hidden_size, bias=bias)
        with torch.no_grad():
            self.dt_proj.bias.copy_(_init_dt_bias(e, 1e-3, 0.1))
        # transformers' names (JambaMambaMixer), so checkpoints map one to one
        self.dt_layernorm = dt_norm
        self.b_layernorm = b_norm
        self.c_layernorm = c_norm

    def new_state(self) -> MambaState:
        return MambaState()

    def forward(
        self, x: Tensor, *, mask: Tensor | None = None, state: MambaState | None = None
    ) -> Tensor:
        """``x [B, L, D] -> [B, L, D]``; continues from and updates ``state`` when given."""
        l = x.shape[1]
        xs, z = self.in_proj(x).chunk(2, dim=-1)  # [B, L, E] each
        xc = causal_conv(xs, self.conv1d, state, mask)  # [B, L, E]
        dt, Bm, Cm = torch.split(
            self.x_proj(xc), [self.dt_rank, self.state_size, self.state_size], -1
        )
        if self.dt_layernorm is not None:
            dt = self.dt_layernorm(dt)
        if self.b_layernorm is not None:
            Bm = self.b_layernorm(Bm)
        if self.c_layernorm is not None:
            Cm = self.c_layernorm(Cm)
        delta = dt @ self.dt_proj.weight.t()  # [B, L, E]; the bias goes in before softplus
        A = -torch.exp(self.A_log.to(x.dtype))
        init = state.ssm if state is not None else None
        if l == 1 and state is not None:
            res = selective_scan_reference(
                xc,
                delta,
                A,
                Bm,
                Cm,
                self.D,
                z,
                delta_bias=self.dt_proj.bias,
                delta_softplus=True,
                mask=mask,
                initial_state=init,
                return_final_state=True,
            )
        else:
            res = selective_scan_chunked(
                xc,
                delta,
                A,
                Bm,
                Cm,
                self.D,
                z,
                delta_bias=self.dt_proj.bias,
                delta_softplus=True,
                mask=mask,
                initial_state=init,
                return_final_state=True,
                chunk_size=min(self.chunk_size, l),
            )
        assert isinstance(res, tuple)
        y, h = res
        if state is not None:
            state.write_ssm(h, l)
        return self.out_proj(y)


class GatedRMSNorm(nn.Module):
    """``RMSNorm(y * silu(z))`` over groups of channels (Mamba-2's output norm).

    Args:
        dim: channels.
        group_size: channels normalised together (``dim / n_groups``).
        eps: added to the mean square.
    """

    def __init__(self, dim: int, *, group_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        if dim % group_size:
            raise ValueError(f"dim ({dim}) must be divisible by group_size ({group_size})")
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: Tensor, z: Tensor) -> Tensor:
        h = y * F.silu(z)
        g = h.view(*h.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view_as(h)


class Mamba2Mixer(nn.Module):
    """The Mamba-2 mixer (SSD).

    Args:
        hidden_size: ``D``.
        num_heads: ``H``.
        head_dim: ``P`` (``H * P`` is the inner width ``E``).
        state_size: ``N``.
        n_groups: ``G`` (heads share ``B``/``C`` in groups); divides ``H``.
        conv_kernel: ``K``.
        conv_bias: a bias in the convolution.
        bias: biases in the input/output projections.
        norm_eps: epsilon of the gated RMSNorm.
        dt_limit: clamp of the step sizes after softplus.
        chunk_size: tokens per chunk of the SSD algorithm.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        state_size: int = 64,
        n_groups: int = 1,
        conv_kernel: int = 4,
        conv_bias: bool = True,
        bias: bool = False,
        norm_eps: float = 1e-5,
        dt_limit: tuple[float, float] = (0.0, math.inf),
        chunk_size: int = 64,
    ) -> None:
        super().__init__()
        for name, v in (
            ("hidden_size", hidden_size),
            ("num_heads", num_heads),
            ("head_dim", head_dim),
            ("state_size", state_size),
            ("n_groups", n_groups),
            ("conv_kernel", conv_kernel),
            ("chunk_size", chunk_size),
        ):
            check_positive_int(name, v)
        if num_heads % n_groups:
            raise ValueError(f"num_heads ({num_heads}) must be divisible by n_groups ({n_groups})")
        e = num_heads * head_dim
        self.num_heads, self.head_dim, self.state_size, self.n_groups = (
            num_heads,
            head_dim,
            state_size,
            n_groups,
        )
        self.intermediate_size = e
        self.conv_dim = e + 2 * n_groups * state_size
        self.dt_limit = (float(dt_limit[0]), float(dt_limit[1]))
        self.chunk_size = chunk_size
        self.in_proj = make_linear(hidden_size, e + self.conv_dim + num_heads, bias=bias)
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            conv_kernel,
            groups=self.conv_dim,
            bias=conv_bias,
            padding=conv_kernel - 1,
        )
        self.dt_bias = nn.Parameter(_init_dt_bias(num_heads, 1e-3, 0.1))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, num_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm = GatedRMSNorm(e, group_size=e // n_groups, eps=norm_eps)
        self.out_proj = make_linear(e, hidden_size, bias=bias)

    def new_state(self) -> Mamba2State:
        return Mamba2State()

    def forward(
        self, x: Tensor, *, mask: Tensor | None = None, state: Mamba2State | None = None
    ) -> Tensor:
        """``x [B, L, D] -> [B, L, D]``; continues from and updates ``state`` when given."""
        b, l, _ = x.shape
        h, p, g, n = self.num_heads, self.head_dim, self.n_groups, self.state_size
        z, xbc, dt = torch.split(self.in_proj(x), [self.intermediate_size, self.conv_dim, h], -1)
        xbc = causal_conv(xbc, self.conv1d, state, mask)  # [B, L, E + 2 G N]
        xs, Bm, Cm = torch.split(xbc, [self.intermediate_size, g * n, g * n], -1)
        dt = F.softplus(dt + self.dt_bias)  # [B, L, H]
        if self.dt_limit != (0.0, math.inf):
            dt = dt.clamp(self.dt_limit[0], self.dt_limit[1])
        A = -torch.exp(self.A_log.to(x.dtype))
        args = (xs.view(b, l, h, p), dt, A, Bm.view(b, l, g, n), Cm.view(b, l, g, n), self.D)
        init = state.ssm if state is not None else None
        if l == 1 and state is not None:
            res = ssd_reference(*args, mask=mask, initial_state=init, return_final_state=True)
        else:
            res = ssd_chunked(
                *args,
                mask=mask,
                initial_state=init,
                return_final_state=True,
                chunk_size=min(self.chunk_size, l),
            )
        assert isinstance(res, tuple)
        y, s = res
        if state is not None:
            state.write_ssm(s, l)
        y = self.norm(y.reshape(b, l, h * p), z)  # [B, L, E]
        return self.out_proj(y)
