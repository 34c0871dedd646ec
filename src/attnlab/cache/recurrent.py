"""Recurrent states: what state-space and recurrent mixers carry between decoding steps.

Where an attention layer keeps every key and value (memory growing with the context),
these layers keep a fixed-size state, the same at 16 tokens and at 16 thousand:

* :class:`MambaState`: the last ``K-1`` inputs of the causal depthwise convolution and
  the SSM state ``[B, D, N]`` (Gu & Dao, 2023).
* :class:`Mamba2State`: the same, with the SSM state per head ``[B, H, P, N]`` (Dao & Gu, 2024).
* :class:`RWKVState`: the token-shift inputs of time-mix and channel-mix and WKV's
  ``(num, den, max)`` sums (Peng et al., 2023).
* :class:`RetentionState`: the retention state ``[B, H, K, V]`` (Sun et al., 2023).

Each is a :class:`~attnlab.cache.base.LayerCache` (``docs/contracts.md``): ``length`` (tokens seen),
``reset()``, ``select(rows)`` (keep/reorder batch rows, for beam search and serving) and
``nbytes()`` (bytes held now, which the cost model checks). The tensors are created on
the first write, in the input's dtype and device; the mixer that owns a state is the only
code that reads or writes its tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.cache.base import LayerCache, check_rows, tensor_nbytes

__all__ = ["Mamba2State", "MambaState", "RWKVState", "RecurrentState", "RetentionState"]


class RecurrentState(LayerCache):
    """A fixed-size per-layer state: named tensors, all with the batch as dimension 0."""

    _fields: tuple[str, ...] = ()

    def __init__(self) -> None:
        super().__init__()  # length: tokens seen (the next token's slot)
        self.batch_size: int | None = None
        for name in self._fields:
            setattr(self, name, None)

    def _tensors(self) -> list[Tensor]:
        return [t for name in self._fields if (t := getattr(self, name)) is not None]

    def reset(self) -> None:
        """Forget the state (the next step starts from zeros)."""
        self.length = 0
        self.batch_size = None
        for name in self._fields:
            setattr(self, name, None)

    def select(self, rows: Tensor) -> None:
        """Keep/reorder batch rows: ``rows`` is a long index tensor ``[B']``."""
        rows = check_rows(rows, self.batch_size)
        for name in self._fields:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, rows.to(t.device)))
        if self.batch_size is not None:
            self.batch_size = int(rows.numel())

    def nbytes(self) -> int:
        """Bytes held by the state's tensors (constant in the context length)."""
        return tensor_nbytes(*self._tensors())

    def _check_rows(self, name: str, x: Tensor) -> None:
        if self.batch_size is None:
            self.batch_size = x.shape[0]
        elif x.shape[0] != self.batch_size:
            raise ValueError(
                f"{name}: batch size {x.shape[0]} does not match the state's batch size "
                f"{self.batch_size}"
            )


class MambaState(RecurrentState):
    """Conv inputs ``conv [B, K-1, C]`` and SSM state ``ssm [B, D, N]`` of one Mamba layer."""

    _fields = ("conv", "ssm")
    conv: Tensor | None
    ssm: Tensor | None

    def conv_window(self, x: Tensor, kernel_size: int) -> Tensor:
        """Prepend the stored inputs to ``x [B, L, C]`` and store the last ``K-1`` inputs.

        Returns:
            ``[B, K-1+L, C]``: what a causal convolution of width ``K`` (no padding) reads.
        """
        self._check_rows("conv input", x)
        keep = kernel_size - 1
        prev = self.conv if self.conv is not None else x.new_zeros((x.shape[0], keep, x.shape[2]))
        if prev.shape[1:] != (keep, x.shape[2]):
            raise ValueError(
                f"conv state holds {tuple(prev.shape)}, the layer needs (batch, {keep}, {x.shape[2]})"
            )
        window = _cat_time(prev, x)
        self.conv = window[:, window.shape[1] - keep :].detach() if keep else prev
        return window

    def write_ssm(self, state: Tensor, num_new: int) -> None:
        """Store the SSM state after ``num_new`` more tokens."""
        self._check_rows("ssm state", state)
        self.ssm = state.detach()
        self.length += num_new


class Mamba2State(MambaState):
    """As :class:`MambaState`, with the SSM state per head ``ssm [B, H, P, N]``."""


class RWKVState(RecurrentState):
    """One RWKV-4 layer: token-shift inputs and WKV's stable sums.

    Attributes:
        att_shift: ``[B, D]`` the time-mix input of the previous token.
        ffn_shift: ``[B, D]`` the channel-mix input of the previous token.
        num, den, max: ``[B, C]`` WKV's sums (real sums ``num * e^max``, ``den * e^max``).
    """

    _fields = ("att_shift", "ffn_shift", "num", "den", "max")
    att_shift: Tensor | None
    ffn_shift: Tensor | None
    num: Tensor | None
    den: Tensor | None
    max: Tensor | None

    def wkv(self) -> tuple[Tensor, Tensor, Tensor] | None:
        if self.num is None or self.den is None or self.max is None:
            return None
        return self.num, self.den, self.max

    def write_wkv(self, state: tuple[Tensor, Tensor, Tensor], num_new: int) -> None:
        self._check_rows("wkv state", state[0])
        self.num, self.den, self.max = (s.detach() for s in state)
        self.length += num_new


class RetentionState(RecurrentState):
    """One retention layer: ``state [B, H, K, V]`` (RetNet's ``S_n``)."""

    _fields = ("state",)
    state: Tensor | None

    def write(self, state: Tensor, num_new: int) -> None:
        self._check_rows("retention state", state)
        self.state = state.detach()
        self.length += num_new


def _cat_time(a: Tensor, b: Tensor) -> Tensor:
    return torch.cat((a.to(b.dtype), b), dim=1)
