"""Longformer's self-attention: a sliding window, plus global tokens with their own projections.

Beltagy et al., 2020, "Longformer: the long-document transformer", sec. 3.1. With
transformers' semantics (``LongformerSelfAttention``):

* every token attends, with the projections ``q_proj``/``k_proj``/``v_proj``, to the
  keys within ``window`` positions on either side (``attention_window = 2 * window``
  in transformers' config) and to every *global* key; padding keys are never seen;
* a global token's output is replaced by its global attention: its query
  (``q_global``) against every non-padding key and value (``k_global``, ``v_global``,
  computed from all tokens);
* padding positions output zeros from the attention (before ``out_proj``).

The local part is one attention call with the pattern
``(sliding_window(window, window) | global_keys) & padding``, so the block-skipping
backends (``sparse``, ``flex``) compute about ``n * (2 * window + globals)`` pairs, not
``n^2``. The global part is ``G`` query rows against all ``n`` keys.

Shape notation: ``B`` batch, ``S`` sequence, ``D`` width, ``H`` heads, ``h_d`` head dim,
``G`` most global tokens in a row.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnlab.functional._checks import check_positive_int, check_probability
from attnlab.functional.attention import scaled_dot_product_attention
from attnlab.functional.masks import MaskPattern, padding, sliding_window
from attnlab.functional.score_mods import ScoreMod
from attnlab.modules.linear import make_linear

__all__ = ["LongformerSelfAttention", "longformer_pattern"]


def longformer_pattern(
    window: int, global_mask: Tensor | None, key_mask: Tensor | None
) -> MaskPattern:
    """The local attention pattern: ``(sliding_window(window, window) | global keys) & padding``.

    Args:
        window: keys on each side of the query (transformers' ``attention_window // 2``).
        global_mask: ``[B, S]`` 1/0 (or bool), 1 at global tokens; None for none.
        key_mask: ``[B, S]`` 1/0, 1 at real tokens; None when nothing is padding.
    """
    pattern = sliding_window(window, window)
    if global_mask is not None:
        # A key-side per-row predicate: "key j is global in row b" (a padding pattern reads
        # exactly that from a 1/0 mask).
        pattern = pattern | padding(global_mask.long())
    if key_mask is not None:
        pattern = pattern & padding(key_mask)
    return pattern


class LongformerSelfAttention(nn.Module):
    """Sliding-window + global attention with separate global projections.

    Args:
        embed_dim: model width ``D``.
        num_heads: heads ``H``.
        window: keys attended on each side (transformers' ``attention_window // 2``).
        dropout: dropout on attention weights (training only; needs a backend that applies
            dropout, so ``"auto"`` picks a dense one when training with dropout).
        backend: attention backend name, or ``"auto"``.
        rotary: a RoPE module ``(x [B, H, S, h_d], positions) -> x`` applied to the local and
            global queries and keys (a long encoder with rotary positions), or None.
        score_mod: an additive score modifier on positions (ALiBi), applied to the local
            pattern tile by tile and to the global rows, or None.

    Parameters: ``q_proj``, ``k_proj``, ``v_proj`` (local), ``q_global``, ``k_global``,
    ``v_global`` (global tokens) and ``out_proj``, each an ``nn.Linear(D, D)``.
    """

    def __init__(
        self,
        *,
        embed_dim: int,
        num_heads: int,
        window: int,
        dropout: float = 0.0,
        backend: str = "auto",
        rotary: nn.Module | None = None,
        score_mod: ScoreMod | None = None,
    ) -> None:
        super().__init__()
        check_positive_int("embed_dim", embed_dim)
        check_positive_int("num_heads", num_heads)
        check_positive_int("window", window)
        check_probability("dropout", dropout)
        if embed_dim % num_heads != 0:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})"
            )
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.window = window
        self.dropout = dropout
        self.backend = backend
        self.rotary = rotary
        self.score_mod = score_mod
        self.q_proj = make_linear(embed_dim, embed_dim)
        self.k_proj = make_linear(embed_dim, embed_dim)
        self.v_proj = make_linear(embed_dim, embed_dim)
        self.q_global = make_linear(embed_dim, embed_dim)
        self.k_global = make_linear(embed_dim, embed_dim)
        self.v_global = make_linear(embed_dim, embed_dim)
        self.out_proj = make_linear(embed_dim, embed_dim)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, head_dim={self.head_dim}, window={self.window}, "
            f"backend={self.backend!r}"
        )

    def _split(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        return x.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)  # [b, n_h, s, h_d]

    def forward(
        self,
        x: Tensor,
        *,
        attn_mask: object = None,
        need_weights: bool = False,
        global_mask: Tensor | None = None,
        key_mask: Tensor | None = None,
        positions: Tensor | None = None,
    ) -> tuple[Tensor, None]:
        """``[B, S, D] -> ([B, S, D], None)``.

        Args:
            x: hidden states.
            attn_mask: must be None (the pattern is built from the two masks below).
            need_weights: not supported (Longformer's weights are banded); must be False.
            global_mask: ``[B, S]`` bool, True at global tokens (never at padding).
            key_mask: ``[B, S]`` bool, True at real tokens; None when none is padding.
            positions: ``[B, S]`` or ``[S]`` token positions for ``rotary`` (default
                ``0..S-1``).
        """
        if attn_mask is not None or need_weights:
            raise ValueError(
                "Longformer attention builds its own pattern from global_attention_mask and "
                "attention_mask, and returns no weights (output_attentions=False)"
            )
        b, s, _ = x.shape
        drop = self.dropout if self.training else 0.0
        any_global = global_mask is not None and bool(global_mask.any())
        pattern = longformer_pattern(self.window, global_mask if any_global else None, key_mask)
        if self.score_mod is not None:
            pattern = pattern.with_scores(self.score_mod)
        q = self._split(self.q_proj(x))  # [b, H, S, h_d]
        k = self._split(self.k_proj(x))
        v = self._split(self.v_proj(x))
        if self.rotary is not None:
            if positions is None:
                positions = torch.arange(s, device=x.device)
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        out = scaled_dot_product_attention(
            q, k, v, attn_mask=pattern, dropout_p=drop, backend=self.backend
        )  # [b, H, S, h_d]
        assert isinstance(out, Tensor)
        out = out.transpose(1, 2).reshape(b, s, self.embed_dim)  # [b, S, D]
        if any_global:
            assert global_mask is not None
            out = self._global_rows(x, out, global_mask, key_mask, drop, positions)
        if key_mask is not None:
            out = out * key_mask.unsqueeze(-1).to(out.dtype)  # padding rows output zeros
        return self.out_proj(out), None

    def _global_rows(
        self,
        x: Tensor,
        out: Tensor,
        global_mask: Tensor,
        key_mask: Tensor | None,
        drop: float,
        positions: Tensor | None,
    ) -> Tensor:
        """Replace the rows of global tokens by their attention over every real key."""
        b, s, d = x.shape
        counts = global_mask.sum(-1)  # [b]
        g = int(counts.max())
        # Row-major order of the global positions, padded to G per row.
        order = torch.argsort((~global_mask).to(torch.int8), dim=-1, stable=True)[:, :g]  # [b, G]
        valid = torch.arange(g, device=x.device)[None, :] < counts[:, None]  # [b, G]
        xg = torch.gather(x, 1, order.unsqueeze(-1).expand(b, g, d))  # [b, G, D]
        qg = self._split(self.q_global(xg))  # [b, H, G, h_d]
        kg = self._split(self.k_global(x))  # [b, H, S, h_d]
        vg = self._split(self.v_global(x))  # [b, H, S, h_d]
        if self.rotary is not None:
            assert positions is not None
            pos = positions.expand(b, s)  # [b, S]
            qg = self.rotary(qg, torch.gather(pos, 1, order))
            kg = self.rotary(kg, pos)
        if self.score_mod is None:
            pattern = None if key_mask is None else padding(key_mask)
            og = scaled_dot_product_attention(
                qg, kg, vg, attn_mask=pattern, dropout_p=drop, backend=self.backend
            )
        else:
            # G query rows at scattered positions: the bias is small ([b, H, G, S]), so it is
            # materialised and run by torch's kernel, which takes a float mask.
            bias = self.score_mod(
                x.new_zeros(b, self.num_heads, g, s, dtype=torch.float32),
                torch.arange(b, device=x.device).view(-1, 1, 1, 1),
                torch.arange(self.num_heads, device=x.device).view(1, -1, 1, 1),
                order.view(b, 1, g, 1),
                torch.arange(s, device=x.device).view(1, 1, 1, s),
            )
            if key_mask is not None:
                bias = bias.masked_fill(~key_mask[:, None, None, :], float("-inf"))
            og = scaled_dot_product_attention(
                qg, kg, vg, attn_mask=bias.to(x.dtype), dropout_p=drop, backend="sdpa"
            )
        assert isinstance(og, Tensor)
        og = og.transpose(1, 2).reshape(b, g, d)  # [b, G, D]
        rows = torch.arange(b, device=x.device)[:, None].expand(b, g)
        out = out.clone()
        out[rows[valid], order[valid]] = og[valid].to(out.dtype)
        return out
