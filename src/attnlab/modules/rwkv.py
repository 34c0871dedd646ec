"""RWKV-4 time-mix and channel-mix (Peng et al., 2023, "RWKV: reinventing RNNs for the
Transformer era", section 4).

Both mix each token with the previous one ("token shift") by learned per-channel weights
``mu``: ``mix(x) = mu * x_t + (1 - mu) * x_{t-1}``. Time-mix then runs the WKV recurrence
(:mod:`attnlab.functional.wkv`) gated by ``sigmoid(r)``; channel-mix is a squared-ReLU
feed-forward gated the same way.

Shape notation: ``B`` batch, ``L`` tokens, ``D`` width, ``C`` attention width, ``I`` the
channel-mix's inner width. Parameter names follow transformers' ``RwkvSelfAttention``
and ``RwkvFeedForward``.

Padding: rows are left-padded; the normalised input is zeroed at padding (the shift of
the first real token then reads zeros, as for a row alone) and WKV skips padding.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnlab.cache.recurrent import RWKVState
from attnlab.functional._checks import check_positive_int
from attnlab.functional.wkv import wkv_chunked, wkv_reference
from attnlab.modules.linear import make_linear

__all__ = ["RWKVChannelMix", "RWKVTimeMix", "token_shift"]


def token_shift(x: Tensor, prev: Tensor | None) -> Tensor:
    """``x [B, L, D]`` moved one token later, with ``prev [B, D]`` (or zeros) first."""
    first = (
        prev[:, None].to(x.dtype) if prev is not None else x.new_zeros((x.shape[0], 1, x.shape[2]))
    )
    return torch.cat((first, x[:, :-1]), dim=1)


def _mask_input(x: Tensor, mask: Tensor | None) -> Tensor:
    return x if mask is None else x * mask[..., None].to(x.dtype)


class RWKVTimeMix(nn.Module):
    """RWKV-4's time-mix (its attention replacement).

    Args:
        hidden_size: ``D``.
        attention_size: ``C`` (default ``D``).
        chunk_size: tokens per chunk of the chunked WKV (prefill and training).
        layer_id, num_layers: set the initial decays and mixes as RWKV-4 does.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        attention_size: int | None = None,
        chunk_size: int = 64,
        layer_id: int = 0,
        num_layers: int = 1,
    ) -> None:
        super().__init__()
        check_positive_int("hidden_size", hidden_size)
        check_positive_int("chunk_size", chunk_size)
        c = attention_size if attention_size is not None else hidden_size
        check_positive_int("attention_size", c)
        self.chunk_size = chunk_size
        ratio = layer_id / max(1, num_layers - 1)  # 0 .. 1
        keep = 1.0 - layer_id / num_layers
        ch = torch.arange(c, dtype=torch.float32) / max(1, c - 1)
        self.time_decay = nn.Parameter(-5 + 8 * ch ** (0.7 + 1.3 * ratio))
        self.time_first = nn.Parameter(
            torch.full((c,), 0.5) + 0.3 * ((torch.arange(c) + 1) % 3 - 1)
        )
        mix = (torch.arange(hidden_size, dtype=torch.float32) / hidden_size)[None, None]
        self.time_mix_key = nn.Parameter(mix**keep)
        self.time_mix_value = nn.Parameter(mix**keep + 0.3 * ratio)
        self.time_mix_receptance = nn.Parameter(mix ** (0.5 * keep))
        self.key = make_linear(hidden_size, c, bias=False)
        self.value = make_linear(hidden_size, c, bias=False)
        self.receptance = make_linear(hidden_size, c, bias=False)
        self.output = make_linear(c, hidden_size, bias=False)

    def forward(
        self, x: Tensor, *, mask: Tensor | None = None, state: RWKVState | None = None
    ) -> Tensor:
        """``x [B, L, D]`` (layer-normed) ``-> [B, L, D]``; updates ``state`` when given."""
        l = x.shape[1]
        x = _mask_input(x, mask)
        shifted = token_shift(x, state.att_shift if state is not None else None)
        k = self.key(x * self.time_mix_key + shifted * (1 - self.time_mix_key))
        v = self.value(x * self.time_mix_value + shifted * (1 - self.time_mix_value))
        r = torch.sigmoid(
            self.receptance(x * self.time_mix_receptance + shifted * (1 - self.time_mix_receptance))
        )
        prev = state.wkv() if state is not None else None
        if l == 1 and state is not None:
            wkv, new = wkv_reference(self.time_decay, self.time_first, k, v, state=prev, mask=mask)
        else:
            wkv, new = wkv_chunked(
                self.time_decay,
                self.time_first,
                k,
                v,
                state=prev,
                mask=mask,
                chunk_size=min(self.chunk_size, l),
            )
        if state is not None:
            state.att_shift = _last_real(x, state.att_shift, mask)
            state.write_wkv(new, l)
        return self.output(r * wkv)


class RWKVChannelMix(nn.Module):
    """RWKV-4's channel-mix: ``sigmoid(r) * W_v relu(W_k k)^2`` on token-shifted inputs.

    Args:
        hidden_size: ``D``.
        intermediate_size: ``I`` (default ``4 D``).
        layer_id, num_layers: set the initial mixes as RWKV-4 does.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        intermediate_size: int | None = None,
        layer_id: int = 0,
        num_layers: int = 1,
    ) -> None:
        super().__init__()
        check_positive_int("hidden_size", hidden_size)
        inner = intermediate_size if intermediate_size is not None else 4 * hidden_size
        check_positive_int("intermediate_size", inner)
        keep = 1.0 - layer_id / num_layers
        mix = (torch.arange(hidden_size, dtype=torch.float32) / hidden_size)[None, None]
        self.time_mix_key = nn.Parameter(mix**keep)
        self.time_mix_receptance = nn.Parameter(mix**keep)
        self.key = make_linear(hidden_size, inner, bias=False)
        self.receptance = make_linear(hidden_size, hidden_size, bias=False)
        self.value = make_linear(inner, hidden_size, bias=False)

    def forward(
        self, x: Tensor, *, mask: Tensor | None = None, state: RWKVState | None = None
    ) -> Tensor:
        """``x [B, L, D]`` (layer-normed) ``-> [B, L, D]``; updates ``state``'s shift."""
        x = _mask_input(x, mask)
        shifted = token_shift(x, state.ffn_shift if state is not None else None)
        k = self.key(x * self.time_mix_key + shifted * (1 - self.time_mix_key))
        r = torch.sigmoid(
            self.receptance(x * self.time_mix_receptance + shifted * (1 - self.time_mix_receptance))
        )
        if state is not None:
            state.ffn_shift = _last_real(x, state.ffn_shift, mask)
        return r * self.value(torch.square(torch.relu(k)))


def _last_real(x: Tensor, prev: Tensor | None, mask: Tensor | None) -> Tensor:
    """The input of each row's last real token (``prev`` or zeros for a row of padding only)."""
    last = x[:, -1]
    if mask is None:
        return last.detach()
    keep = prev if prev is not None else torch.zeros_like(last)
    return torch.where(mask[:, -1:].bool(), last, keep.to(last.dtype)).detach()
