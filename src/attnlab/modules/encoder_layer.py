"""One Transformer encoder layer with pre-LN or post-LN placement of the norms.

Shape notation: ``B`` batch, ``S`` sequence, ``D`` model width, ``H`` heads.

* post-LN (Vaswani et al., 2017; BERT): ``x = norm(x + drop(attn(x)))``, then
  ``x = norm(x + ffn(x))``.
* pre-LN (Xiong et al., 2020; the tutorial's layer, GPT-2): ``x = x + drop(attn(norm(x)))``,
  then ``x = x + ffn(norm(x))``; the stack ends with one more norm.
"""

from __future__ import annotations

from typing import Any, Literal

from torch import Tensor, nn

from attnlab.functional.attention import AttnMask

__all__ = ["EncoderLayer", "NormPosition"]

NormPosition = Literal["pre", "post"]


class EncoderLayer(nn.Module):
    """Self-attention and feed-forward sublayers with residuals and norms.

    Args:
        attention: the self-attention module (:class:`MultiHeadAttention`, or
            :class:`~attnlab.modules.longformer_attention.LongformerSelfAttention`), called as
            ``attention(x, attn_mask=..., need_weights=..., **attention_kwargs)``.
        feed_forward: the feed-forward module (its own dropout included).
        attn_norm: norm of the attention sublayer.
        ffn_norm: norm of the feed-forward sublayer.
        norm_position: ``"post"`` (BERT) or ``"pre"`` (the tutorial, GPT-2).
        dropout: dropout on the attention sublayer's output (training only).
    """

    def __init__(
        self,
        *,
        attention: nn.Module,
        feed_forward: nn.Module,
        attn_norm: nn.Module,
        ffn_norm: nn.Module,
        norm_position: NormPosition = "post",
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if norm_position not in ("pre", "post"):
            raise ValueError(f"norm_position must be 'pre' or 'post', got {norm_position!r}")
        self.attention = attention
        self.feed_forward = feed_forward
        self.attn_norm = attn_norm
        self.ffn_norm = ffn_norm
        self.norm_position = norm_position
        self.dropout = nn.Dropout(dropout)

    def extra_repr(self) -> str:
        return f"norm_position={self.norm_position!r}"

    def forward(
        self,
        x: Tensor,
        *,
        attn_mask: AttnMask = None,
        need_weights: bool = False,
        **attention_kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
        """``[B, S, D] -> ([B, S, D], weights [B, H, S, S] or None)``.

        ``attention_kwargs`` go to the attention module (positions for RoPE, Longformer's
        global and key masks).
        """
        if self.norm_position == "post":
            a, w = self.attention(
                x, attn_mask=attn_mask, need_weights=need_weights, **attention_kwargs
            )
            x = self.attn_norm(x + self.dropout(a))
            x = self.ffn_norm(x + self.feed_forward(x))
        else:
            h = self.attn_norm(x)
            a, w = self.attention(
                h, attn_mask=attn_mask, need_weights=need_weights, **attention_kwargs
            )
            x = x + self.dropout(a)
            x = x + self.feed_forward(self.ffn_norm(x))
        return x, w
