"""Recurrent states of the linear-attention and gated-recurrence mixers.

Each carries the last ``K-1`` inputs of its causal short convolution (``conv [B, K-1, C]``,
as :class:`~attnlab.cache.recurrent.MambaState`) and, except the short convolution, one
fixed-size recurrent tensor:

* :class:`DeltaNetState`: DeltaNet / Gated DeltaNet's matrix ``ssm [B, H, K, V]``.
* :class:`GLAState`: gated linear attention's matrix ``ssm [B, H, K, V]``.
* :class:`RGLRUState`: the RG-LRU's vector ``ssm [B, D]`` (Griffin, RecurrentGemma).
* :class:`ShortConvState`: LFM2's gated short convolution: the convolution window alone.
* :class:`RWKV7State`: RWKV-7's token-shift input ``shift [B, D]`` and matrix ``ssm [B, H, K, V]``.

They are :class:`~attnlab.cache.base.LayerCache` s (``length``, ``reset()``,
``select(rows)``, ``nbytes()``: constant in the context length).
"""

from __future__ import annotations

from torch import Tensor

from attnlab.cache.recurrent import MambaState, RecurrentState

__all__ = ["DeltaNetState", "GLAState", "RGLRUState", "RWKV7State", "ShortConvState"]


class DeltaNetState(MambaState):
    """Conv inputs ``conv [B, K-1, C]`` and the delta-rule state ``ssm [B, H, K, V]``."""


class GLAState(MambaState):
    """Conv inputs (unused: GLA has no convolution) and the GLA state ``ssm [B, H, K, V]``."""


class RGLRUState(MambaState):
    """Conv inputs ``conv [B, K-1, W]`` and the RG-LRU state ``ssm [B, W]``."""


class ShortConvState(MambaState):
    """The gated short convolution's inputs ``conv [B, K-1, D]`` (no other state)."""

    def advance(self, num_new: int) -> None:
        """Count ``num_new`` more tokens (the mixer stores the window in ``conv``)."""
        self.length += num_new


class RWKV7State(RecurrentState):
    """RWKV-7 time mix: the previous token's input ``shift [B, D]`` and ``ssm [B, H, K, V]``."""

    _fields = ("shift", "ssm")
    shift: Tensor | None
    ssm: Tensor | None

    def write(self, shift: Tensor, ssm: Tensor, num_new: int) -> None:
        """Store the last token's input and the state after ``num_new`` more tokens."""
        self._check_rows("shift input", shift)
        self.shift, self.ssm = shift.detach(), ssm.detach()
        self.length += num_new
