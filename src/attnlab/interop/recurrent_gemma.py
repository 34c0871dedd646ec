"""RecurrentGemma (``model_type == "recurrent_gemma"``) <-> :class:`DecoderLM` with a hybrid layout.

Botev et al. (2024), "RecurrentGemma"; De et al. (2024), "Griffin": Griffin's recurrent
blocks (RG-LRU with a short convolution) and local multi-query attention in the repeating
pattern ``block_types`` (by default two recurrent blocks, then one attention block), each
followed by a gated GELU feed-forward. In attnlab that is a ``DecoderConfig.layers`` layout
of ``LayerSpec(mixer="rglru" | "attention")`` (:mod:`attnlab.models.linear_mixers`).

What maps to what:

* Gemma's norms, ``x (1 + w)`` (``norm="gemma_rmsnorm"``), and the embeddings scaled by
  ``sqrt(hidden_size)`` rounded to bfloat16, as transformers stores its ``normalizer``;
* local attention: ``sliding_window = attention_window_size``, RoPE on half of each head
  (``partial_rotary_factor``), a bias on the output projection only;
* the feed-forward is ``intermediate_size / 2`` wide, with biases, ``gelu_pytorch_tanh``;
* the logits are soft-capped at ``logits_soft_cap`` (``final_logit_softcapping``);
* the RG-LRU's gates are block-diagonal over ``num_attention_heads`` blocks and it resets
  at position 0, as transformers' ``RecurrentGemmaRglru``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from attnlab.interop.hf import require_transformers
from attnlab.interop.hybrid import (
    hybrid_converter,
    layer_key_map,
    linear_settings,
    special_tokens,
    special_tokens_to_hf,
)
from attnlab.interop.llama import rope_from_hf
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.layout import LayerSpec
from attnlab.models.linear_layout import LinearLayerConfig

__all__ = ["RECURRENT_GEMMA"]

# attnlab sub-module path -> transformers sub-module path, within one layer
_PARTS = {
    "self_attn_norm": "temporal_pre_norm",
    "ffn_norm": "channel_pre_norm",
    "self_attention.q_proj": "temporal_block.q_proj",
    "self_attention.k_proj": "temporal_block.k_proj",
    "self_attention.v_proj": "temporal_block.v_proj",
    "self_attention.out_proj": "temporal_block.o_proj",
    "self_attention.mixer": "temporal_block",  # the recurrent block keeps transformers' names
    "feed_forward.gate_proj": "mlp_block.gate_proj",
    "feed_forward.up_proj": "mlp_block.up_proj",
    "feed_forward.down_proj": "mlp_block.down_proj",
}


def embedding_scale(hidden_size: int) -> float:
    """``sqrt(hidden_size)`` rounded to bfloat16, as RecurrentGemma's ``normalizer`` buffer."""
    return float(torch.tensor(hidden_size**0.5, dtype=torch.bfloat16))


def _partial_rotary(cfg: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """``(partial_rotary_factor, cfg without it)``: transformers keeps it in ``rope_parameters``."""
    cfg = dict(cfg)
    params = dict(cfg.get("rope_parameters") or {})
    factor = params.pop("partial_rotary_factor", cfg.pop("partial_rotary_factor", 0.5))
    cfg["rope_parameters"] = params or None
    return float(factor), cfg


def recurrent_gemma_config(cfg: dict[str, Any], weight_names: set[str]) -> DecoderConfig:
    """The attnlab config of a transformers ``RecurrentGemmaConfig`` (as a dict)."""
    n, d, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    blocks = list(cfg.get("block_types") or ("recurrent", "recurrent", "attention"))
    if not blocks or any(b not in ("recurrent", "attention") for b in blocks):
        raise ValueError(f"block_types must list 'recurrent'/'attention', got {blocks!r}")
    lru = LinearLayerConfig(
        width=cfg.get("lru_width") or d,
        num_heads=heads,
        conv_kernel=int(cfg.get("conv1d_width", 4)),
    )
    kinds = (blocks * n)[:n]
    layers = tuple(
        LayerSpec() if k == "attention" else LayerSpec(mixer="rglru", linear=lru) for k in kinds
    )
    factor, cfg = _partial_rotary(cfg)
    theta, scaling = rope_from_hf(cfg)
    if cfg.get("intermediate_size", 2) % 2:
        raise ValueError(f"intermediate_size must be even, got {cfg['intermediate_size']}")
    return DecoderConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=d,
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=d // heads,
        intermediate_size=cfg.get("intermediate_size", 3 * d) // 2,
        hidden_act=cfg.get("hidden_activation", "gelu_pytorch_tanh"),
        mlp_bias=True,
        norm="gemma_rmsnorm",
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        position_embedding="rope",
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=factor,
        sliding_window=int(cfg.get("attention_window_size", 2048)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        attention_out_bias=True,
        attention_dropout=float(cfg.get("attention_dropout", 0.0) or 0.0),
        embedding_scale=embedding_scale(d),
        final_logit_softcapping=float(cfg.get("logits_soft_cap", 30.0)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        max_position_embeddings=max(8192, int(cfg.get("attention_window_size", 2048))),
        **special_tokens(cfg),
        layers=layers,
        model_type="recurrent_gemma",
    )


def key_map(model: nn.Module) -> dict[str, str]:
    """attnlab keys -> transformers keys."""
    return layer_key_map(model, _PARTS, final_norm="final_norm")


def _block_types(c: DecoderConfig) -> list[str]:
    """The shortest repeating ``block_types`` of ``c``'s layout, or ValueError."""
    kinds = ["attention" if s.mixer == "attention" else "recurrent" for s in c.layer_specs]
    n = len(kinds)
    for p in range(1, n + 1):
        if all(kinds[i] == kinds[i % p] for i in range(n)):
            return kinds[:p]
    raise AssertionError("unreachable: the whole layout is a period")


def _check(c: DecoderConfig) -> LinearLayerConfig:
    specs = c.layer_specs
    if any(s.mixer not in ("attention", "rglru") or s.ffn != "dense" for s in specs):
        raise ValueError(
            "RecurrentGemma has RG-LRU or attention layers, each with a dense feed-forward; "
            f"got {[(s.mixer, s.ffn) for s in specs]}"
        )
    lrus = linear_settings(c, "rglru")
    lru = lrus.pop() if len(lrus) == 1 else None
    if lru is None or (lru.num_heads or c.num_attention_heads) != c.num_attention_heads:
        raise ValueError(
            "RecurrentGemma has one RG-LRU setting, with num_attention_heads gate blocks"
        )
    if (
        c.norm != "gemma_rmsnorm"
        or c.mlp != "gated"
        or not c.mlp_bias
        or c.attention_out_bias is not True
        or c.attention_bias
        or c.sliding_window is None
        or c.final_logit_softcapping is None
        or c.embedding_scale != embedding_scale(c.hidden_size)
        or c.position_embedding != "rope"
        or c.rope_scaling is not None
        or c.qk_norm
        or c.head_dim != c.hidden_size // c.num_attention_heads
    ):
        raise ValueError(
            "RecurrentGemma is Gemma's norms and scaled embeddings, a gated MLP with biases, "
            "local attention with RoPE and a bias on the output only, soft-capped logits "
            "and head_dim = hidden_size / num_attention_heads"
        )
    return lru


def recurrent_gemma_to_hf(model: nn.Module) -> nn.Module:
    assert isinstance(model, DecoderLM)
    c = model.config
    lru = _check(c)
    tf = require_transformers()
    cfg = tf.RecurrentGemmaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=2 * c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        lru_width=lru.width or c.hidden_size,
        attention_window_size=c.sliding_window,
        conv1d_width=lru.conv_kernel,
        logits_soft_cap=c.final_logit_softcapping,
        rms_norm_eps=c.norm_eps,
        hidden_activation=c.hidden_act,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": c.rope_theta,
            "partial_rotary_factor": c.partial_rotary_factor,
        },
        block_types=_block_types(c),
        attention_dropout=c.attention_dropout,
        tie_word_embeddings=c.tie_word_embeddings,
        **special_tokens_to_hf(c),
    )
    return tf.RecurrentGemmaForCausalLM(cfg)


RECURRENT_GEMMA = hybrid_converter(
    model_type="recurrent_gemma",
    hf_class="RecurrentGemmaForCausalLM",
    config_from_hf=recurrent_gemma_config,
    key_map=key_map,
    to_hf_model=recurrent_gemma_to_hf,
    mixer="rglru",
)
