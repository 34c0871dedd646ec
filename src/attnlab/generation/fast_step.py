"""A lean one-token decode step for :class:`~attnlab.models.decoder.DecoderLM` (the fast path).

Shape notation: ``B`` batch, ``T`` slots so far, ``D`` width, ``H``/``H_kv`` heads,
``h_d`` head dim, ``V`` vocabulary.

During generation each step runs one token through every layer; at small model sizes
the time goes to Python and module dispatch rather than arithmetic. :class:`FastDecodeStep`
runs the same weights (used in place, not copied) with the same functions
(:func:`~attnlab.functional.positions.apply_rope`, the layers' norms and activations,
torch's fused attention) as straight-line code over the model's
:class:`~attnlab.cache.DynamicKVCache` buffers. The modules stay the reference: tests
check that both paths give the same tokens and logits.

It covers eval-mode models whose cache is contiguous (no sliding window) with
LayerNorm/RMSNorm norms; :func:`fast_step_for` returns None otherwise and generation
runs the modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.cache.kv_cache import DynamicKVCache, ModelCache
from attnlab.functional.positions import apply_rope
from attnlab.functional.slot_masks import positions_from_mask, slot_mask
from attnlab.models.decoder import DecoderLM
from attnlab.modules.attention import MultiHeadAttention
from attnlab.modules.decoder_layer import DecoderLayer
from attnlab.modules.mlp import FeedForward, GatedFeedForward
from attnlab.modules.norms import RMSNorm

__all__ = ["FastDecodeStep", "fast_step_for"]

Weights = tuple[Tensor, Tensor | None]


@dataclass
class _Norm:
    module: nn.Module
    weight: Tensor
    bias: Tensor | None
    eps: float
    rms: bool

    @classmethod
    def of(cls, norm: nn.Module) -> _Norm:
        if isinstance(norm, RMSNorm):
            return cls(norm, norm.weight, None, norm.eps, True)
        assert isinstance(norm, nn.LayerNorm) and norm.weight is not None
        return cls(norm, norm.weight, norm.bias, norm.eps, False)

    def __call__(self, x: Tensor) -> Tensor:
        if not self.rms:
            return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        out: Tensor = self.module(x)  # the module's own mixed-precision recipe
        return out


def _w(linear: nn.Linear) -> Weights:
    return linear.weight, linear.bias


@dataclass
class _Layer:
    attn_norm: _Norm
    q: Weights
    k: Weights
    v: Weights
    o: Weights
    scale: float | None
    ffn_norm: _Norm
    act: Callable[[Tensor], Tensor]
    gate: Weights | None  # gated MLP: down(act(gate(x)) * up(x))
    up: Weights
    down: Weights


class FastDecodeStep:
    """One-token decode step of a :class:`DecoderLM` over its contiguous KV caches.

    Args:
        model: the model, in eval mode; its parameters are used in place.
    """

    def __init__(self, model: DecoderLM) -> None:
        self.model = model
        c = model.config
        assert c.head_dim is not None and c.num_key_value_heads is not None
        self.h, self.h_kv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.layers: list[_Layer] = []
        for layer in model.layers:
            assert isinstance(layer, DecoderLayer)
            attn, ff = layer.self_attention, layer.feed_forward
            assert isinstance(attn, MultiHeadAttention) and layer.ffn_norm is not None
            if isinstance(ff, GatedFeedForward):
                gate, up, down = _w(ff.gate_proj), _w(ff.up_proj), _w(ff.down_proj)
            else:
                assert isinstance(ff, FeedForward)
                gate, up, down = None, _w(ff.fc_in), _w(ff.fc_out)
            self.layers.append(
                _Layer(
                    attn_norm=_Norm.of(layer.self_attn_norm),
                    q=_w(attn.q_proj),
                    k=_w(attn.k_proj),
                    v=_w(attn.v_proj),
                    o=_w(attn.out_proj),
                    scale=attn.scale,
                    ffn_norm=_Norm.of(layer.ffn_norm),
                    act=ff.act,
                    gate=gate,
                    up=up,
                    down=down,
                )
            )
        self.final_norm = _Norm.of(model.norm)
        self.head = model.output_weight

    def __call__(
        self,
        tokens: Tensor,
        *,
        cache: ModelCache,
        attention_mask: Tensor | None,
        position_ids: Tensor | None,
    ) -> Tensor:
        """Logits ``[B, 1, V]`` for ``tokens [B, 1]`` at the next slot of ``cache``.

        Args:
            tokens: the new token of each row.
            cache: the model's caches (all :class:`DynamicKVCache`), updated in place.
            attention_mask: ``[B, T + 1]`` 1/0 over all slots, or None (no padding).
            position_ids: ``[B, 1]`` positions of the new tokens, or None (= the slot).
        """
        model = self.model
        b = tokens.shape[0]
        start = cache.length
        device = tokens.device
        pos = position_ids
        if pos is None:
            pos = torch.full((1, 1), start, dtype=torch.long, device=device)
        x = F.embedding(tokens, model.embed_tokens.weight)  # [B, 1, D]
        if model.embed_positions is not None:
            x = x + model.embed_positions(pos)
        if model.embed_norm is not None:
            x = model.embed_norm(x)
        rotary = model.rotary
        cos = sin = None
        if rotary is not None:
            cos, sin = rotary.angles(pos)  # [B|1, 1, h_d/2]
        mask: Tensor | None = None
        if attention_mask is not None:
            k_slots = torch.arange(start + 1, device=device)
            mask = slot_mask(k_slots[start:], k_slots, attention_mask=attention_mask)
        if model.alibi is not None:
            k_pos = (
                positions_from_mask(attention_mask)
                if attention_mask is not None
                else torch.arange(start + 1, device=device)[None]
            )
            bias = model.alibi(pos, k_pos)  # [B|1, H, 1, T+1]
            mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
            mask = mask.to(x.dtype)  # as the attention backends pass a float mask
        h, h_kv, hd = self.h, self.h_kv, self.hd
        for lw, lc in zip(self.layers, cache.layers):
            assert isinstance(lc, DynamicKVCache)
            y = lw.attn_norm(x)
            q = F.linear(y, *lw.q).view(b, 1, h, hd).transpose(1, 2)  # [B, H, 1, h_d]
            k = F.linear(y, *lw.k).view(b, 1, h_kv, hd).transpose(1, 2)  # [B, H_kv, 1, h_d]
            v = F.linear(y, *lw.v).view(b, 1, h_kv, hd).transpose(1, 2)
            if rotary is not None and cos is not None and sin is not None:
                q = apply_rope(q, cos, sin, convention=rotary.convention)
                k = apply_rope(k, cos, sin, convention=rotary.convention)
            keys, values = lc.update(k, v, start=start)  # [B, H_kv, T+1, h_d]
            o = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=lw.scale, enable_gqa=h_kv != h
            )  # [B, H, 1, h_d]
            x = x + F.linear(o.transpose(1, 2).reshape(b, 1, h * hd), *lw.o)
            y = lw.ffn_norm(x)
            if lw.gate is not None:
                y = lw.act(F.linear(y, *lw.gate)) * F.linear(y, *lw.up)
            else:
                y = lw.act(F.linear(y, *lw.up))
            x = x + F.linear(y, *lw.down)
        return F.linear(self.final_norm(x), self.head)  # [B, 1, V]


def fast_step_for(model: object, cache: object) -> FastDecodeStep | None:
    """A :class:`FastDecodeStep` when ``model``/``cache`` are supported, else None.

    Supported: a :class:`DecoderLM` in eval mode without sliding window, with dense
    feed-forwards only, :class:`DynamicKVCache` caches and LayerNorm/RMSNorm norms.
    """
    if not isinstance(model, DecoderLM) or model.training or not isinstance(cache, ModelCache):
        return None
    if model.config.sliding_window is not None:
        return None
    if not all(
        isinstance(layer.self_attention, MultiHeadAttention)
        and isinstance(layer.feed_forward, FeedForward | GatedFeedForward)
        for layer in model.layers
    ):
        return None  # MoE or state-space layers: the model's own forward
    if not all(isinstance(c, DynamicKVCache) for c in cache.layers):
        return None
    norms = [model.norm] + [
        n for layer in model.layers for n in (layer.self_attn_norm, layer.ffn_norm)
    ]
    if not all(isinstance(n, RMSNorm | nn.LayerNorm) for n in norms):
        return None
    return FastDecodeStep(model)
