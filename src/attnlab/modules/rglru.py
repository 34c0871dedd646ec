"""Griffin's recurrent block (RG-LRU) and LFM2's gated short convolution, as mixers.

De et al. (2024), "Griffin", figure 2 (the recurrent block), as RecurrentGemma builds it:

    y = gelu_tanh(linear_y(x))
    u = conv_1d(linear_x(x))                      (causal depthwise, kernel 4, no activation)
    out = linear_out(rg_lru(u) * y)

Liquid AI (2025), LFM2's ``Lfm2ShortConv``: ``B, C, x = in_proj(x)``,
``out = out_proj(C * conv(B * x))`` (kernel 3, no activation).

Shape notation: ``B`` batch, ``L`` tokens, ``D`` width, ``W`` the LRU width, ``H`` the
gates' blocks (block-diagonal gate matrices, ``W / H`` wide). Parameter names follow
transformers' ``RecurrentGemmaRecurrentBlock`` and ``Lfm2ShortConv``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.cache.linear_state import RGLRUState, ShortConvState
from attnlab.functional._checks import check_positive_int
from attnlab.functional.rglru import (
    linear_recurrence_scan,
    linear_recurrence_step,
    rglru_coefficients,
)
from attnlab.functional.short_conv import short_conv, short_conv_step

__all__ = ["RGLRU", "GatedShortConv", "RecurrentBlock"]


def _conv(
    x: Tensor, conv: nn.Conv1d, state: ShortConvState | RGLRUState | None, mask: Tensor | None
) -> Tensor:
    """Causal depthwise convolution of ``x [B, L, C]`` (no activation); padding reads as zeros."""
    if mask is not None:
        x = x * mask[..., None].to(x.dtype)
    weight = conv.weight[:, 0]  # [C, K]
    k = weight.shape[1]
    prev = state.conv if state is not None else None
    if x.shape[1] == 1 and prev is not None and k > 1:
        y, window = short_conv_step(x[:, 0], weight, conv.bias, prev)
        y = y[:, None]
    else:
        y, window = short_conv(x, weight, conv.bias, state=prev)
    if state is not None:
        state._check_rows("conv input", x)
        state.conv = window.detach()
    return y


class RGLRU(nn.Module):
    """The real-gated linear recurrent unit (gates block-diagonal over ``H`` blocks).

    Args:
        width: ``W``.
        num_blocks: ``H`` (divides ``W``).
        chunk_size: tokens per chunk of the parallel scan.
    """

    def __init__(self, *, width: int, num_blocks: int, chunk_size: int = 64) -> None:
        super().__init__()
        check_positive_int("width", width)
        check_positive_int("num_blocks", num_blocks)
        if width % num_blocks:
            raise ValueError(f"width ({width}) must be divisible by num_blocks ({num_blocks})")
        self.num_blocks, self.block_width, self.chunk_size = (
            num_blocks,
            width // num_blocks,
            chunk_size,
        )
        w = self.block_width
        self.recurrent_param = nn.Parameter(torch.empty(width).uniform_(-4.0, -1.0))
        self.input_gate_weight = nn.Parameter(torch.randn(num_blocks, w, w) * w**-0.5)
        self.input_gate_bias = nn.Parameter(torch.zeros(num_blocks, w))
        self.recurrent_gate_weight = nn.Parameter(torch.randn(num_blocks, w, w) * w**-0.5)
        self.recurrent_gate_bias = nn.Parameter(torch.zeros(num_blocks, w))

    def _gate(self, x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        b, l, _ = x.shape
        xs = x.view(b, l, self.num_blocks, self.block_width)
        return torch.sigmoid(torch.einsum("blhi,hij->blhj", xs, weight) + bias).reshape(b, l, -1)

    def forward(
        self,
        x: Tensor,
        *,
        reset: Tensor | None,
        mask: Tensor | None,
        state: RGLRUState | None,
    ) -> Tensor:
        """``x [B, L, W] -> [B, L, W]``; ``reset [B, L]`` marks each sequence's first token."""
        i_gate = self._gate(x, self.input_gate_weight, self.input_gate_bias)
        r_gate = self._gate(x, self.recurrent_gate_weight, self.recurrent_gate_bias)
        a, u = rglru_coefficients(x, i_gate, r_gate, self.recurrent_param, reset=reset, mask=mask)
        init = state.ssm if state is not None else None
        if x.shape[1] == 1 and init is not None:
            h_last = linear_recurrence_step(a[:, 0], u[:, 0], init)
            h = h_last[:, None]
        else:
            h, h_last = linear_recurrence_scan(a, u, state=init, chunk_size=self.chunk_size)
        if state is not None:
            state.write_ssm(h_last, x.shape[1])
        return h


class RecurrentBlock(nn.Module):
    """Griffin's recurrent block: a gelu branch times the conv + RG-LRU branch.

    Args:
        hidden_size: ``D``.
        lru_width: ``W``.
        num_blocks: the gates' blocks ``H`` (RecurrentGemma: its attention heads).
        conv_kernel: the convolution's width (4).
        chunk_size: tokens per chunk of the parallel scan.
    """

    uses_positions = True  # the RG-LRU resets at position 0, as RecurrentGemma

    def __init__(
        self,
        *,
        hidden_size: int,
        lru_width: int,
        num_blocks: int,
        conv_kernel: int = 4,
        chunk_size: int = 64,
    ) -> None:
        super().__init__()
        check_positive_int("hidden_size", hidden_size)
        check_positive_int("conv_kernel", conv_kernel)
        self.linear_y = nn.Linear(hidden_size, lru_width)
        self.linear_x = nn.Linear(hidden_size, lru_width)
        self.linear_out = nn.Linear(lru_width, hidden_size)
        self.conv_1d = nn.Conv1d(
            lru_width, lru_width, conv_kernel, groups=lru_width, padding=conv_kernel - 1
        )
        self.rg_lru = RGLRU(width=lru_width, num_blocks=num_blocks, chunk_size=chunk_size)

    def new_state(self) -> RGLRUState:
        return RGLRUState()

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        state: RGLRUState | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """``x [B, L, D] -> [B, L, D]``; ``positions [B or 1, L]`` (0 starts a sequence)."""
        b, l, _ = x.shape
        y = F.gelu(self.linear_y(x), approximate="tanh")
        u = _conv(self.linear_x(x), self.conv_1d, state, mask)
        if positions is None:
            start = state.length if state is not None else 0
            positions = torch.arange(start, start + l, device=x.device)[None]
        reset = (positions == 0).expand(b, l)
        h = self.rg_lru(u, reset=reset, mask=mask, state=state)
        return self.linear_out(h * y)


class GatedShortConv(nn.Module):
    """LFM2's gated short convolution: ``out_proj(C * conv(B * x))``.

    Args:
        hidden_size: ``D``.
        conv_kernel: the convolution's width (LFM2's ``conv_L_cache``, 3).
        bias: biases in the projections and the convolution.
    """

    def __init__(self, *, hidden_size: int, conv_kernel: int = 3, bias: bool = False) -> None:
        super().__init__()
        check_positive_int("hidden_size", hidden_size)
        check_positive_int("conv_kernel", conv_kernel)
        d = hidden_size
        self.conv = nn.Conv1d(d, d, conv_kernel, groups=d, bias=bias, padding=conv_kernel - 1)
        self.in_proj = nn.Linear(d, 3 * d, bias=bias)
        self.out_proj = nn.Linear(d, d, bias=bias)

    def new_state(self) -> ShortConvState:
        return ShortConvState()

    def forward(
        self, x: Tensor, *, mask: Tensor | None = None, state: ShortConvState | None = None
    ) -> Tensor:
        """``x [B, L, D] -> [B, L, D]``; continues from and updates ``state`` when given."""
        bg, cg, xs = self.in_proj(x).chunk(3, dim=-1)
        y = cg * _conv(bg * xs, self.conv, state, mask)
        if state is not None:
            state.advance(x.shape[1])
        return self.out_proj(y)
