"""Multi-head attention: MHA, GQA and MQA from one module, self- and cross-attention.

Shape notation: ``B`` batch, ``L`` query length, ``S`` key length, ``D`` model
width, ``H`` query heads, ``H_kv`` key/value heads, ``h_d`` head dim.

The module owns the projections; the attention itself is
:func:`attnlab.scaled_dot_product_attention`, run on the backend the
module was given (``"auto"`` by default). Variants are chosen by arguments, not
flags: ``num_kv_heads == num_heads`` is multi-head attention (Vaswani et al., 2017),
``1 < num_kv_heads < num_heads`` grouped-query attention (Ainslie et al., 2023),
``num_kv_heads == 1`` multi-query attention (Shazeer, 2019).

Components, passed to the constructor, add the position schemes of decoders:

* ``rotary``: a module ``(x [B, H, S, h_d], positions [B, S]) -> x`` applied to the
  queries and the new keys (RoPE, Su et al., 2021);
* ``scale``: the score scale (T5 uses 1.0).

Biases on the scores (ALiBi, T5's relative bias, soft-capping) are not components: they
are score modifiers attached to the mask pattern (``pattern.with_scores(...)``), which
every backend evaluates on the call's query/key positions (``q_positions``,
``k_positions``; ``docs/contracts.md``, section 1), tile by tile where it can.

The model path is ``forward(x, plan, cache)`` (``context=`` for cross-attention): the
:class:`~attnlab.backends.plan.AttentionPlan` built once per forward, and the layer's
cache, which turns the new keys/values into the plan's ``KVView``; nothing is asked of
the registry or validated there. Without a plan, keywords describe the call for direct
use, validated, through the public ``scaled_dot_product_attention``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from attnlab.backends import get as _get_backend
from attnlab.backends.api import scaled_dot_product_attention
from attnlab.backends.dispatch import attend
from attnlab.backends.plan import AttentionPlan, KVView
from attnlab.cache.base import CrossAttentionCache, KVCache, Start
from attnlab.functional._checks import (
    check_positive_int,
    check_probability,
    check_scale,
    check_tensor,
)
from attnlab.functional.attention import AttnMask
from attnlab.functional.masks import combine, padding, padding_mask
from attnlab.modules.attention_layouts import layout_state_dict
from attnlab.modules.fused_linear import FusedProjection
from attnlab.modules.linear import make_linear

__all__ = ["MultiHeadAttention"]


def check_backend_name(backend: object) -> str:
    """Return ``backend`` if it is ``"auto"`` or a registered backend's name.

    Called by modules and models at construction, so a typo fails there, not at the
    first forward.

    Raises:
        TypeError: not a string.
        ValueError: no backend of that name (the message lists the known ones).
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a backend name (str), got {backend!r}")
    if backend != "auto":
        _get_backend(backend)
    return backend


class MultiHeadAttention(nn.Module):
    """Multi-head attention with ``num_kv_heads`` key/value heads.

    Args:
        embed_dim: model width ``D`` of the queries (and of the output).
        num_heads: query heads ``H``.
        num_kv_heads: key/value heads ``H_kv``; must divide ``num_heads``.
            Default ``num_heads`` (plain MHA).
        head_dim: per-head width; default ``embed_dim // num_heads`` (which must divide).
        kv_embed_dim: width of the key/value input for cross-attention; default ``embed_dim``.
        bias: bias on the q/k/v projections.
        out_bias: bias on the output projection; default ``bias``.
        dropout: dropout on the attention weights (training only).
        backend: attention backend name, or ``"auto"``.
        rotary: position module applied to queries and keys (e.g.
            :class:`~attnlab.modules.positions.RotaryEmbedding`), or None.
        scale: score scale; default ``1/sqrt(head_dim)``.
        q_norm: a norm applied to the whole query projection ``[.., H * E]`` before the
            heads are split (OLMoE's and OLMo 2's QK-norm), or None.
        k_norm: the same for the key projection ``[.., H_kv * E]``, or None.

    Parameters are ``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj`` (separate
    ``nn.Linear``s, the Hugging Face BERT/Llama layout). :meth:`load_layout`
    also reads the tutorial's per-head layout and torch's packed ``in_proj``.
    """

    def __init__(
        self,
        *,
        embed_dim: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        kv_embed_dim: int | None = None,
        bias: bool = True,
        out_bias: bool | None = None,
        dropout: float = 0.0,
        backend: str = "auto",
        rotary: nn.Module | None = None,
        scale: float | None = None,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
    ) -> None:
        super().__init__()
        check_positive_int("embed_dim", embed_dim)
        check_positive_int("num_heads", num_heads)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        check_positive_int("num_kv_heads", num_kv_heads)
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})"
            )
        if head_dim is None:
            if embed_dim % num_heads != 0:
                raise ValueError(
                    f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads}), "
                    "or pass head_dim explicitly"
                )
            head_dim = embed_dim // num_heads
        else:
            check_positive_int("head_dim", head_dim)
        check_probability("dropout", dropout)
        check_scale(scale)
        check_backend_name(backend)
        kv_embed_dim = embed_dim if kv_embed_dim is None else kv_embed_dim
        self.embed_dim = embed_dim
        self.kv_embed_dim = kv_embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dropout = dropout
        self.backend = backend
        self.rotary = rotary
        self.scale = scale
        self.q_proj = make_linear(embed_dim, num_heads * head_dim, bias=bias)
        self.k_proj = make_linear(kv_embed_dim, num_kv_heads * head_dim, bias=bias)
        self.v_proj = make_linear(kv_embed_dim, num_kv_heads * head_dim, bias=bias)
        self.out_proj = make_linear(
            num_heads * head_dim, embed_dim, bias=bias if out_bias is None else out_bias
        )
        self.q_norm = q_norm
        self.k_norm = k_norm
        #: q/k/v as one matmul for self-attention (inference-only derived state, not a
        #: submodule: :func:`attnlab.models.fuse.fuse_projections`), or None
        self.fused_qkv: FusedProjection | None = None

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, backend={self.backend!r}"
        )

    def _split(self, x: Tensor, heads: int) -> Tensor:
        b, s, _ = x.shape
        return x.view(b, s, heads, self.head_dim).transpose(1, 2)  # [b, n_h, s, h_d]

    def forward(
        self,
        query: Tensor,
        plan: AttentionPlan | None = None,
        cache: KVCache | CrossAttentionCache | None = None,
        *,
        context: Tensor | None = None,
        attention_mask: Tensor | None = None,
        attn_mask: AttnMask = None,
        is_causal: bool = False,
        need_weights: bool = False,
        positions: Tensor | None = None,
        cache_start: Start = 0,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``query`` to itself (or to ``context``).

        Args:
            query: the queries' input ``[B, L, D]`` (``x``, for a model's layer).
            plan: the forward's attention plan (the model path: no other keyword but
                ``context`` may be given), or None to describe the call with keywords.
            cache: a self-attention cache (the new keys/values are stored at the plan's
                ``start``, or ``cache_start``, and every cached one is attended to) or a
                cross-attention cache (filled on the first call; ``context`` is then not
                needed).
            context: ``[B, S, D_kv]`` the key/value input of cross-attention.
            attention_mask: key padding ``[B, S]`` of 1 (token) / 0 (padding), the
                Hugging Face convention (keyword path).
            attn_mask: bool (True = attend) or float (added) mask broadcasting to
                ``[B, H, L, S]``, or a mask pattern (keyword path).
            is_causal: causal self-attention (keyword path).
            need_weights: also return the attention weights ``[B, H, L, S]`` (keyword
                path; a plan says it in its call).
            positions: ``[B, L]`` (or ``[L]``) position ids for the ``rotary``
                component; default ``cache_start .. cache_start+L-1`` (keyword path).
            cache_start: slot of the first query token in the cache (keyword path).

        Returns:
            ``(output [B, L, D], weights or None)``.

        Raises:
            TypeError: ``plan`` is not an :class:`AttentionPlan` (pass a key/value
                input as ``context=``), or keywords given together with a plan.
        """
        if plan is not None:
            if not isinstance(plan, AttentionPlan):
                raise TypeError(
                    f"plan must be an AttentionPlan, got {type(plan).__name__}; pass the "
                    "key/value input of cross-attention as context="
                )
            if (
                attention_mask is not None
                or attn_mask is not None
                or is_causal
                or need_weights
                or positions is not None
                or not (isinstance(cache_start, int) and cache_start == 0)
            ):
                raise TypeError(
                    "pass either a plan or the keywords attention_mask/attn_mask/is_causal/"
                    "need_weights/positions/cache_start, not both: the plan holds them"
                )
            return self._planned(query, plan, cache, context)
        return self._keywords(
            query,
            cache,
            context,
            attention_mask,
            attn_mask,
            is_causal,
            need_weights,
            positions,
            cache_start,
        )

    def _project(self, x: Tensor, context: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """``(q [B, H, L, h_d], k [B, H_kv, S, h_d], v [B, H_kv, S, h_d])``."""
        kv_in = x if context is None else context
        if self.fused_qkv is not None and context is None:
            q_flat, k_flat, v_flat = self.fused_qkv(x)  # views of one [b, L, (H+2H_kv)*h_d]
        else:
            q_flat, k_flat = self.q_proj(x), self.k_proj(kv_in)  # [b, L, H*h_d], [b, S, H_kv*h_d]
            v_flat = self.v_proj(kv_in)  # [b, S, H_kv*h_d]
        if self.q_norm is not None:
            q_flat = self.q_norm(q_flat)
        if self.k_norm is not None:
            k_flat = self.k_norm(k_flat)
        q = self._split(q_flat, self.num_heads)  # [b, H, L, h_d]
        k = self._split(k_flat, self.num_kv_heads)  # [b, H_kv, S, h_d]
        v = self._split(v_flat, self.num_kv_heads)  # [b, H_kv, S, h_d]
        return q, k, v

    def _query(self, x: Tensor) -> Tensor:
        q_flat = self.q_proj(x)  # [b, L, H*h_d]
        if self.q_norm is not None:
            q_flat = self.q_norm(q_flat)
        return self._split(q_flat, self.num_heads)  # [b, H, L, h_d]

    def _out(self, out: Tensor, b: int, length: int) -> Tensor:
        out = out.transpose(1, 2).reshape(b, length, -1)  # [b, L, H*h_d]
        return self.out_proj(out)

    def _planned(
        self,
        x: Tensor,
        plan: AttentionPlan,
        cache: KVCache | CrossAttentionCache | None,
        context: Tensor | None,
    ) -> tuple[Tensor, Tensor | None]:
        """The model path: project, rotate, hand the new keys/values to the cache, attend."""
        b, length = x.shape[:2]
        if isinstance(cache, CrossAttentionCache) and cache.filled:
            assert cache.key is not None and cache.value is not None
            out, w = attend(plan, self._query(x), KVView(cache.key, cache.value), scale=self.scale)
            return self._out(out, b, length), w
        q, k, v = self._project(x, context)
        if self.rotary is not None and context is None:
            pos = plan.positions
            if pos is None:
                pos = plan.start + torch.arange(length, device=x.device)
            q, k = self.rotary(q, pos), self.rotary(k, pos)
        if isinstance(cache, CrossAttentionCache):
            cache.store(k, v)
            view = KVView(k, v)
        elif cache is not None:
            view = cache.view(k, v, plan)
        else:
            view = KVView(k, v, plan.k_positions)
        out, w = attend(plan, q, view, scale=self.scale)
        return self._out(out, b, length), w

    def _keywords(
        self,
        query: Tensor,
        cache: KVCache | CrossAttentionCache | None,
        context: Tensor | None,
        attention_mask: Tensor | None,
        attn_mask: AttnMask,
        is_causal: bool,
        need_weights: bool,
        positions: Tensor | None,
        cache_start: Start,
    ) -> tuple[Tensor, Tensor | None]:
        """The keyword path: validated, through the public attention call."""
        check_tensor("query", query)
        if isinstance(cache, CrossAttentionCache) and cache.filled:
            return self._attend_cached_cross(query, cache, attn_mask, need_weights)
        key = query if context is None else context
        self._check_inputs(query, key, key)
        mask: AttnMask = attn_mask
        if attention_mask is not None:
            mask = self._with_padding(attn_mask, attention_mask, key.shape[0], key.shape[1])
        q, k, v = self._project(query, context)
        if self.rotary is not None:
            if positions is None:
                positions = cache_start + torch.arange(query.shape[1], device=query.device)
            q = self.rotary(q, positions)
            if context is None:  # self-attention: keys rotate at the queries' positions
                k = self.rotary(k, positions)
        if isinstance(cache, CrossAttentionCache):
            cache.store(k, v)
        elif cache is not None:
            k, v = cache.update(k, v, start=cache_start)  # [b, H_kv, S_all, h_d]
        return self._attend(q, k, v, mask, is_causal, need_weights)

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        check_tensor("key", key)
        check_tensor("value", value)
        if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
            raise ValueError(
                "query, key and value must be (batch, seq_len, embed_dim), got shapes "
                f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
            )
        if query.shape[-1] != self.embed_dim:
            raise ValueError(
                f"query has width {query.shape[-1]}, expected embed_dim={self.embed_dim}"
            )
        if key.shape[-1] != self.kv_embed_dim or value.shape[-1] != self.kv_embed_dim:
            raise ValueError(
                f"key/value have widths {key.shape[-1]}/{value.shape[-1]}, expected "
                f"kv_embed_dim={self.kv_embed_dim}"
            )
        if not (query.shape[0] == key.shape[0] == value.shape[0]):
            raise ValueError(
                f"batch sizes differ: query {query.shape[0]}, key {key.shape[0]}, value {value.shape[0]}"
            )
        if key.shape[1] != value.shape[1]:
            raise ValueError(f"key length {key.shape[1]} != value length {value.shape[1]}")
        want = self.q_proj.weight.dtype
        for name, t in (("query", query), ("key", key), ("value", value)):
            mixed = t.dtype != want and not torch.is_autocast_enabled(t.device.type)
            if not t.is_floating_point() or mixed:  # not the projection's "mat1 and mat2"
                raise TypeError(
                    f"{name} is {t.dtype}; this module's weights are {want}: pass {want} "
                    "hidden states (token ids go through an embedding first)"
                )

    @staticmethod
    def _with_padding(attn_mask: AttnMask, attention_mask: Tensor, b: int, s: int) -> AttnMask:
        """``attn_mask`` restricted to the real keys of ``attention_mask`` ``[B, S]``."""
        check_tensor("attention_mask", attention_mask)
        if tuple(attention_mask.shape) != (b, s):
            raise ValueError(
                f"attention_mask must be (batch, key_len) = {(b, s)}, got "
                f"{tuple(attention_mask.shape)}"
            )
        if isinstance(attn_mask, Tensor):  # a dense mask from the user stays dense
            return combine(attn_mask, padding_mask(attention_mask))
        pad = padding(attention_mask)
        if attn_mask is None:
            return pad
        if attn_mask.score_mods:
            return (attn_mask._unscored() & pad).with_scores(*attn_mask.score_mods)
        return attn_mask & pad

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: AttnMask,
        is_causal: bool,
        need_weights: bool,
    ) -> tuple[Tensor, Tensor | None]:
        b, _, length, _ = q.shape
        result = scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal,
            scale=self.scale,
            enable_gqa=self.num_kv_heads != self.num_heads,
            backend=self.backend,
            return_weights=need_weights,
        )
        out, weights = result if isinstance(result, tuple) else (result, None)
        return self._out(out, b, length), weights

    def _attend_cached_cross(
        self, query: Tensor, cache: CrossAttentionCache, attn_mask: AttnMask, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        assert cache.key is not None and cache.value is not None
        if query.dim() != 3 or query.shape[-1] != self.embed_dim:
            raise ValueError(
                f"query must be (batch, seq_len, {self.embed_dim}), got {tuple(query.shape)}"
            )
        if cache.key.shape[0] != query.shape[0]:
            raise ValueError(
                f"batch size {query.shape[0]} does not match the cross-attention cache's "
                f"{cache.key.shape[0]}"
            )
        q = self._query(query)  # [b, H, L, h_d]
        return self._attend(q, cache.key, cache.value, attn_mask, False, need_weights)

    # ------------------------------------------------------------------ layouts

    def load_layout(self, state_dict: Mapping[str, Tensor], layout: str = "native") -> None:
        """Load weights stored in another layout.

        Args:
            state_dict: the weights.
            layout: one of

                * ``"native"``: this module's own keys (``q_proj.weight``, ...);
                * ``"per_head"``: the tutorial's layout, one ``nn.Linear`` per head and
                  projection: ``heads.{i}.q.weight`` ``[h_d, D]`` (and ``k``, ``v``,
                  with biases), plus ``output_linear.weight``/``.bias``;
                * ``"packed"``: torch ``nn.MultiheadAttention``'s fused
                  ``in_proj_weight`` ``[3*D, D]`` (q, k, v stacked), ``in_proj_bias``,
                  ``out_proj.weight``/``.bias``.

        Raises:
            ValueError: unknown layout, missing keys or shapes that do not fit.
        """
        self.load_state_dict(layout_state_dict(self, state_dict, layout))
