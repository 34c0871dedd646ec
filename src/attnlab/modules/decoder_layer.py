"""One Transformer decoder layer: a sequence mixer, optional cross-attention, feed-forward.

Shape notation: ``B`` batch, ``L`` new tokens, ``S_enc`` encoder length, ``D`` width.

* pre-LN (GPT-2, Llama, BLOOM, T5): ``x = x + drop(sublayer(norm(x)))`` per sublayer;
  the stack ends with one more norm.
* post-LN (Vaswani et al., 2017): ``x = norm(x + drop(sublayer(x)))``.
* sandwich (pre-LN with a norm on each sublayer's output, Gemma 2 and 3):
  ``x = x + drop(post_norm(sublayer(norm(x))))``.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor, nn

from attnlab.backends.plan import AttentionPlan
from attnlab.cache.base import CrossAttentionCache, LayerCache
from attnlab.modules.attention import MultiHeadAttention
from attnlab.modules.encoder_layer import NormPosition
from attnlab.modules.moe import MoEOutput

__all__ = ["CrossInputs", "DecoderLayer", "DecoderLayerOutput"]


class DecoderLayerOutput(NamedTuple):
    """What a decoder layer returns (unpacks as a 4-tuple).

    Attributes:
        hidden: ``[B, L, D]``.
        self_weights: self-attention weights when asked for, else None.
        cross_weights: cross-attention weights when asked for, else None.
        router_logits: ``[B * L, E]`` when the feed-forward is a mixture of experts.
    """

    hidden: Tensor
    self_weights: Tensor | None
    cross_weights: Tensor | None
    router_logits: Tensor | None


class CrossInputs(NamedTuple):
    """What a decoder layer's cross-attention reads in one forward.

    Attributes:
        hidden: ``[B, S_enc, D]`` the encoder output (None once ``cache`` is filled).
        plan: the cross-attention plan (encoder padding as its pattern).
        cache: this layer's cross-attention cache, or None.
    """

    hidden: Tensor | None
    plan: AttentionPlan
    cache: CrossAttentionCache | None = None


class DecoderLayer(nn.Module):
    """Sequence mixer (+ cross-attention) + feed-forward with residuals and norms.

    Args:
        self_attention: the sequence mixer: the (causal) self-attention module with its
            position components, or any mixer registered in :mod:`attnlab.models.mixers`
            (called as ``mixer(h, plan, cache)``, returning ``(output, weights or None)``).
        feed_forward: the feed-forward module (:class:`~attnlab.modules.mlp.FeedForward`,
            :class:`~attnlab.modules.mlp.GatedFeedForward`, or a
            :class:`~attnlab.modules.moe.MoEBlock` whose router logits the layer returns;
            one with ``reads_state = True`` is called as ``ffn(h, plan, cache)``), or
            None for a mixer-only layer.
        self_attn_norm: norm of the self-attention sublayer.
        ffn_norm: norm of the feed-forward sublayer (None with no feed-forward).
        cross_attention: encoder-decoder attention, or None for a decoder-only model.
        cross_attn_norm: norm of the cross-attention sublayer (with ``cross_attention``).
        norm_position: ``"pre"`` or ``"post"``.
        dropout: dropout on each sublayer's output (training only).
        post_attn_norm: a norm on the self-attention sublayer's output before the
            residual (pre-LN only: the sandwich layout), or None.
        post_ffn_norm: the same for the feed-forward sublayer, or None.
    """

    def __init__(
        self,
        *,
        self_attention: nn.Module,
        feed_forward: nn.Module | None,
        self_attn_norm: nn.Module,
        ffn_norm: nn.Module | None,
        cross_attention: MultiHeadAttention | None = None,
        cross_attn_norm: nn.Module | None = None,
        norm_position: NormPosition = "pre",
        dropout: float = 0.0,
        post_attn_norm: nn.Module | None = None,
        post_ffn_norm: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if norm_position not in ("pre", "post"):
            raise ValueError(f"norm_position must be 'pre' or 'post', got {norm_position!r}")
        if norm_position == "post" and (post_attn_norm or post_ffn_norm) is not None:
            raise ValueError("post_attn_norm/post_ffn_norm (the sandwich) need norm_position='pre'")
        if post_ffn_norm is not None and feed_forward is None:
            raise ValueError("post_ffn_norm needs a feed_forward")
        if (cross_attention is None) != (cross_attn_norm is None):
            raise ValueError("cross_attention and cross_attn_norm go together")
        if (feed_forward is None) != (ffn_norm is None):
            raise ValueError("feed_forward and ffn_norm go together")
        self.self_attention = self_attention
        self.self_attn_norm = self_attn_norm
        self.cross_attention = cross_attention
        self.cross_attn_norm = cross_attn_norm
        self.feed_forward = feed_forward
        self.ffn_norm = ffn_norm
        self.norm_position = norm_position
        self.dropout = nn.Dropout(dropout)
        self.post_attn_norm = post_attn_norm
        self.post_ffn_norm = post_ffn_norm
        self._ffn_reads_state = bool(getattr(feed_forward, "reads_state", False))

    def extra_repr(self) -> str:
        return f"norm_position={self.norm_position!r}"

    def _sublayer(
        self, x: Tensor, norm: nn.Module, fn: object, post: nn.Module | None = None
    ) -> tuple[Tensor, Tensor | None]:
        assert callable(fn)
        drop = self.dropout.p > 0 and self.training
        if self.norm_position == "pre":
            out, w = fn(norm(x))
            if post is not None:
                out = post(out)
            return x + (self.dropout(out) if drop else out), w
        out, w = fn(x)
        return norm(x + (self.dropout(out) if drop else out)), w

    def forward(
        self,
        x: Tensor,
        plan: AttentionPlan,
        cache: LayerCache | None = None,
        cross: CrossInputs | None = None,
    ) -> DecoderLayerOutput:
        """``[B, L, D] -> (hidden [B, L, D], self weights, cross weights, router logits)``.

        Args:
            x: the new tokens' hidden states.
            plan: the forward's attention plan (the mixer reads what it needs: slots,
                pattern, backend, the new tokens' padding for a state).
            cache: this layer's cache (a KV cache, or the mixer's recurrent state).
            cross: the encoder output, plan and cache of cross-attention.

        Raises:
            ValueError: a layer with cross-attention and no ``cross`` inputs.
        """

        def self_attn(h: Tensor) -> tuple[Tensor, Tensor | None]:
            out: tuple[Tensor, Tensor | None] = self.self_attention(h, plan, cache)
            return out

        x, self_w = self._sublayer(x, self.self_attn_norm, self_attn, self.post_attn_norm)
        cross_w = None
        if self.cross_attention is not None:
            x, cross_w = self._cross(x, cross)
        router_logits = None
        if self.feed_forward is not None:
            feed_forward = self.feed_forward

            def ffn(h: Tensor) -> tuple[Tensor, Tensor | None]:
                # a feed-forward with a state of its own (RWKV's channel mix) reads the
                # plan and the layer's cache, as the mixer does
                out = feed_forward(h, plan, cache) if self._ffn_reads_state else feed_forward(h)
                if isinstance(out, MoEOutput):
                    return out.hidden, out.router_logits
                return out, None

            assert self.ffn_norm is not None
            x, router_logits = self._sublayer(x, self.ffn_norm, ffn, self.post_ffn_norm)
        return DecoderLayerOutput(x, self_w, cross_w, router_logits)

    def _cross(self, x: Tensor, cross: CrossInputs | None) -> tuple[Tensor, Tensor | None]:
        attention = self.cross_attention
        assert attention is not None and self.cross_attn_norm is not None
        filled = cross is not None and cross.cache is not None and cross.cache.filled
        if cross is None or (cross.hidden is None and not filled):
            raise ValueError("a decoder layer with cross-attention needs encoder_hidden_states")

        def attend(h: Tensor) -> tuple[Tensor, Tensor | None]:
            out: tuple[Tensor, Tensor | None] = attention(
                h, cross.plan, cross.cache, context=cross.hidden
            )
            return out

        return self._sublayer(x, self.cross_attn_norm, attend)
