"""Recurrent states of the linear-attention and gated-recurrence mixers.

Each carries the last ``K-1`` inputs of its causal short convolution (``conv [B, K-1, C]``,
as :class:`~attnlab.cache.recurrent.MambaState`) and, except the short convolution, one
fixed-size recurrent tensor:

* :class:`DeltaNetState`: DeltaNet / Gated DeltaNet's matrix ``ssm [B, H, K, V]``.
* :class:`GLAState`: gated linear attention's matrix ``ssm [B, H, K, V]``.
* :class:`RGLRUState`: the RG-LRU's vector ``ssm [B, D]`` (Griffin, RecurrentGemma).
* :class:`ShortConvState`: LFM2's gated short convolution: the convolution window alone.

They are :class:`~attnlab.cache.base.LayerCache` s (``length``, ``reset()``,
``select(rows)``, ``nbytes()``: constant in the context length).
"""

from __future__ import annotations

from attnlab.cache.recurrent import MambaState

__all__ = ["DeltaNetState", "GLAState", "RGLRUState", "ShortConvState"]


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
