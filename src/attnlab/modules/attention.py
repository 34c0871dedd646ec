"""Multi-head attention: MHA, GQA and MQA from one module, self- and cross-attention.

Shape notation: ``B`` batch, ``L`` query length, ``S`` key length, ``D`` model
width, ``H`` query heads, ``H_kv`` key/value heads, ``h_d`` head dim.

The module owns the projections; the attention itself is
:func:`attnlab.functional.scaled_dot_product_attention`, run on the backend the
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

Per call, ``cache`` (a :class:`~attnlab.cache.KVCache` for self-attention, a
:class:`~attnlab.cache.CrossAttentionCache` for encoder-decoder attention) with the
explicit slot ``cache_start`` of the first new token. A model passes the
:class:`~attnlab.backends.registry.AttentionCall` it built once per forward (``call``):
the layer then takes the registry's trusted path and does not re-validate.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from attnlab.backends import get as _get_backend
from attnlab.backends.registry import AttentionCall, dispatch_trusted
from attnlab.cache.base import CrossAttentionCache, KVCache, Start
from attnlab.functional._checks import (
    check_positive_int,
    check_probability,
    check_scale,
    check_tensor,
)
from attnlab.functional.attention import AttnMask, scaled_dot_product_attention
from attnlab.functional.masks import combine, padding, padding_mask
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
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        attention_mask: Tensor | None = None,
        attn_mask: AttnMask = None,
        is_causal: bool = False,
        need_weights: bool = False,
        positions: Tensor | None = None,
        q_positions: Tensor | None = None,
        k_positions: Tensor | None = None,
        cache: KVCache | CrossAttentionCache | None = None,
        cache_start: Start = 0,
        call: AttentionCall | None = None,
        backend: str | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``query`` to ``key``/``value``.

        Args:
            query: ``[B, L, D]``.
            key: ``[B, S, D_kv]``; default ``query`` (self-attention).
            value: ``[B, S, D_kv]``; default ``key``.
            attention_mask: key padding ``[B, S]`` of 1 (token) / 0 (padding), the
                Hugging Face convention.
            attn_mask: bool (True = attend) or float (added) mask broadcasting to
                ``[B, H, L, S]``, or a mask pattern (with its score modifiers).
            is_causal: causal self-attention (query ``i`` sees keys ``j <= i``).
            need_weights: also return the attention weights ``[B, H, L, S]``.
            positions: ``[B, L]`` (or ``[L]``) position ids of the queries for the
                ``rotary`` component; default ``cache_start .. cache_start+L-1``.
            q_positions: long ``[B or 1, L]`` slots of the queries, where the pattern
                and score modifiers evaluate them (default ``arange(L)``).
            k_positions: long ``[B or 1, S]`` slots of the keys attended to (cached
                ones included; ``-1`` = empty), e.g. the cache's ``key_slots``.
            cache: a self-attention cache (the new keys/values are stored at slots
                ``cache_start..`` and all cached ones are attended to) or a
                cross-attention cache (filled on the first call, then ``key``/``value``
                are not needed).
            cache_start: slot of the first query token in the cache (an int, or a long
                tensor: a compiled step's position).
            call: the call a model built once per forward; the trusted path (no
                validation here).
            backend: the backend the model resolved for ``call`` (default: the
                module's ``backend``).

        Returns:
            ``(output [B, L, D], weights or None)``.
        """
        if call is None:
            check_tensor("query", query)
        if isinstance(cache, CrossAttentionCache) and cache.filled:
            return self._attend_cached_cross(
                query, cache, attn_mask=attn_mask, need_weights=need_weights, call=call
            )
        key = query if key is None else key
        value = key if value is None else value
        mask: AttnMask = attn_mask
        if call is None:
            self._check_inputs(query, key, value)
            if attention_mask is not None:
                mask = self._with_padding(attn_mask, attention_mask, key.shape[0], key.shape[1])
        q_flat, k_flat = self.q_proj(query), self.k_proj(key)  # [b, L, H*h_d], [b, S, H_kv*h_d]
        if self.q_norm is not None:
            q_flat = self.q_norm(q_flat)
        if self.k_norm is not None:
            k_flat = self.k_norm(k_flat)
        q = self._split(q_flat, self.num_heads)  # [b, H, L, h_d]
        k = self._split(k_flat, self.num_kv_heads)  # [b, H_kv, S, h_d]
        v = self._split(self.v_proj(value), self.num_kv_heads)  # [b, H_kv, S, h_d]
        if self.rotary is not None:
            if positions is None:
                positions = cache_start + torch.arange(query.shape[1], device=query.device)
            q = self.rotary(q, positions)
            if key is query:  # self-attention: keys rotate at the queries' positions
                k = self.rotary(k, positions)
        if isinstance(cache, CrossAttentionCache):
            cache.store(k, v)
        elif cache is not None:
            name = self.backend if backend is None else backend
            if (
                call is not None
                and call.block_size
                and name != "auto"
                and _get_backend(name).reads_blocks
            ):  # a paged cache's pools and block tables, no gather
                k, v, table = cache.update_blocks(k, v, start=cache_start)  # type: ignore[attr-defined]
                return self._attend(
                    q, k, v, mask, is_causal, need_weights, q_positions, None, call, name, table
                )
            k, v = cache.update(k, v, start=cache_start)  # [b, H_kv, S_all, h_d]
        return self._attend(
            q, k, v, mask, is_causal, need_weights, q_positions, k_positions, call, backend
        )

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
        q_positions: Tensor | None = None,
        k_positions: Tensor | None = None,
        call: AttentionCall | None = None,
        backend: str | None = None,
        block_table: object | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        b, _, length, _ = q.shape
        dropout = self.dropout if self.training else 0.0
        if call is None:
            result = scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=dropout,
                is_causal=is_causal,
                scale=self.scale,
                enable_gqa=self.num_kv_heads != self.num_heads,
                backend=self.backend,
                return_weights=need_weights,
                q_positions=q_positions,
                k_positions=k_positions,
            )
            out, weights = result if isinstance(result, tuple) else (result, None)
        else:
            out, weights = dispatch_trusted(
                call,
                q,
                k,
                v,
                mask if isinstance(mask, Tensor) else None,
                scale=self.scale,
                backend=self.backend if backend is None else backend,
                q_positions=q_positions,
                k_positions=k_positions,
                block_table=block_table,
            )
        out = out.transpose(1, 2).reshape(b, length, -1)  # [b, L, H*h_d]
        return self.out_proj(out), weights

    def _attend_cached_cross(
        self,
        query: Tensor,
        cache: CrossAttentionCache,
        *,
        attn_mask: AttnMask,
        need_weights: bool,
        call: AttentionCall | None,
    ) -> tuple[Tensor, Tensor | None]:
        assert cache.key is not None and cache.value is not None
        if call is None:
            if query.dim() != 3 or query.shape[-1] != self.embed_dim:
                raise ValueError(
                    f"query must be (batch, seq_len, {self.embed_dim}), got {tuple(query.shape)}"
                )
            if cache.key.shape[0] != query.shape[0]:
                raise ValueError(
                    f"batch size {query.shape[0]} does not match the cross-attention cache's "
                    f"{cache.key.shape[0]}"
                )
        q_flat = self.q_proj(query)  # [b, L, H*h_d]
        if self.q_norm is not None:
            q_flat = self.q_norm(q_flat)
        q = self._split(q_flat, self.num_heads)  # [b, H, L, h_d]
        return self._attend(q, cache.key, cache.value, attn_mask, False, need_weights, call=call)

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
        if layout == "native":
            converted = dict(state_dict)
        elif layout == "per_head":
            converted = self._from_per_head(state_dict)
        elif layout == "packed":
            converted = self._from_packed(state_dict)
        else:
            raise ValueError(
                f"unknown layout {layout!r}; expected 'native', 'per_head' or 'packed'"
            )
        own = self.state_dict()
        missing = sorted(set(own) - set(converted))
        unexpected = sorted(set(converted) - set(own))
        if missing or unexpected:
            raise ValueError(
                f"layout {layout!r}: missing keys {missing}, unexpected keys {unexpected}"
            )
        for name, t in converted.items():
            if t.shape != own[name].shape:
                raise ValueError(
                    f"layout {layout!r}: {name} has shape {tuple(t.shape)}, expected "
                    f"{tuple(own[name].shape)}"
                )
        self.load_state_dict(converted)

    def _from_per_head(self, sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
        if self.num_kv_heads != self.num_heads:
            raise ValueError(
                "the per-head layout has one key/value projection per query head; it cannot "
                f"load into num_kv_heads={self.num_kv_heads} < num_heads={self.num_heads}"
            )
        n = sum(1 for k in sd if k.startswith("heads.") and k.endswith(".q.weight"))
        if n != self.num_heads:
            raise ValueError(f"per-head state dict has {n} heads, the module has {self.num_heads}")
        out: dict[str, Tensor] = {}
        for src, dst in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
            for kind in ("weight", "bias"):
                keys = [f"heads.{i}.{src}.{kind}" for i in range(n)]
                if all(k in sd for k in keys):
                    out[f"{dst}.{kind}"] = torch.cat([sd[k] for k in keys], dim=0)
        for kind in ("weight", "bias"):
            if f"output_linear.{kind}" in sd:
                out[f"out_proj.{kind}"] = sd[f"output_linear.{kind}"]
        return out

    def _from_packed(self, sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
        if "in_proj_weight" not in sd:
            raise ValueError(f"packed layout needs 'in_proj_weight', got keys {sorted(sd)}")
        qd, kd = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        sizes = [qd, kd, kd]
        w = sd["in_proj_weight"]
        if w.shape[0] != sum(sizes):
            raise ValueError(
                f"in_proj_weight has {w.shape[0]} rows, expected {sum(sizes)} (q {qd} + k {kd} + v {kd})"
            )
        out = dict(zip(("q_proj.weight", "k_proj.weight", "v_proj.weight"), w.split(sizes, dim=0)))
        if "in_proj_bias" in sd and sd["in_proj_bias"] is not None:
            out |= dict(
                zip(("q_proj.bias", "k_proj.bias", "v_proj.bias"), sd["in_proj_bias"].split(sizes))
            )
        for kind in ("weight", "bias"):
            if f"out_proj.{kind}" in sd:
                out[f"out_proj.{kind}"] = sd[f"out_proj.{kind}"]
        return out
