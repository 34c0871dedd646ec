"""LFM2 (``model_type == "lfm2"``) <-> :class:`DecoderLM` with a hybrid layout.

Liquid AI (2025), LFM2: gated short convolutions (``out_proj(C * conv(B * x))``, kernel
``conv_L_cache``) in most layers and GQA attention in the layers ``layer_types`` marks
``"full_attention"``, each followed by a SwiGLU feed-forward. In attnlab that is a
``DecoderConfig.layers`` layout of ``LayerSpec(mixer="short_conv" | "attention")``
(:mod:`attnlab.models.linear_mixers`); one :class:`~attnlab.cache.base.ModelCache` holds a
KV cache per attention layer and a :class:`~attnlab.cache.linear_state.ShortConvState` per
convolution layer.

What maps to what:

* the attention layers norm each head's queries and keys (``qk_norm_scope="head"``,
  ``q_layernorm``/``k_layernorm``) and name their output projection ``out_proj``;
* the feed-forward's width is ``block_ff_dim`` adjusted as transformers does when
  ``block_auto_adjust_ff_dim`` (``2/3``, the multiplier, rounded up to ``block_multiple_of``);
* the final norm is called ``embedding_norm`` in transformers.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from attnlab.interop.hf import require_transformers
from attnlab.interop.hybrid import (
    hybrid_converter,
    layer_key_map,
    linear_settings,
    special_tokens,
    special_tokens_to_hf,
)
from attnlab.interop.llama import rope_from_hf, rope_to_hf
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.layout import LayerSpec
from attnlab.models.linear_layout import LinearLayerConfig

__all__ = ["LFM2"]

CONV, FULL = "conv", "full_attention"

# attnlab sub-module path -> transformers sub-module path, within one layer
_PARTS = {
    "self_attn_norm": "operator_norm",
    "ffn_norm": "ffn_norm",
    "self_attention.q_proj": "self_attn.q_proj",
    "self_attention.k_proj": "self_attn.k_proj",
    "self_attention.v_proj": "self_attn.v_proj",
    "self_attention.out_proj": "self_attn.out_proj",
    "self_attention.q_norm.norm": "self_attn.q_layernorm",
    "self_attention.k_norm.norm": "self_attn.k_layernorm",
    "self_attention.mixer": "conv",  # the short convolution keeps transformers' names
    "feed_forward.gate_proj": "feed_forward.w1",
    "feed_forward.up_proj": "feed_forward.w3",
    "feed_forward.down_proj": "feed_forward.w2",
}


def ffn_width(cfg: dict[str, Any]) -> int:
    """The feed-forward's inner width, as ``Lfm2MLP`` derives it."""
    width = int(cfg.get("block_ff_dim", cfg["intermediate_size"]))
    if cfg.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        mult = cfg.get("block_ffn_dim_multiplier", 1.0)
        if mult is not None:
            of = int(cfg.get("block_multiple_of", 256))
            width = of * ((int(mult * width) + of - 1) // of)
    return width


def lfm2_config(cfg: dict[str, Any], weight_names: set[str]) -> DecoderConfig:
    """The attnlab config of a transformers ``Lfm2Config`` (as a dict)."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        full = cfg.get("full_attn_idxs")
        full = list(range(n)) if full is None else full
        types = [FULL if i in full else CONV for i in range(n)]
    if len(types) != n or any(t not in (CONV, FULL) for t in types):
        raise ValueError(f"layer_types must list {n} of {[CONV, FULL]}, got {types!r}")
    conv = LinearLayerConfig(
        conv_kernel=int(cfg.get("conv_L_cache", 3)), conv_bias=bool(cfg.get("conv_bias", False))
    )
    layers = tuple(
        LayerSpec() if t == FULL else LayerSpec(mixer="short_conv", linear=conv) for t in types
    )
    theta, scaling = rope_from_hf(cfg)
    heads = cfg["num_attention_heads"]
    return DecoderConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg["hidden_size"] // heads,
        intermediate_size=ffn_width(cfg),
        hidden_act="silu",
        norm_eps=cfg.get("norm_eps", 1e-5),
        max_position_embeddings=cfg.get("max_position_embeddings", 128000),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", cfg.get("tie_embedding", True))),
        qk_norm=True,
        qk_norm_scope="head",
        **special_tokens(cfg),
        layers=layers,
        model_type="lfm2",
    )


def key_map(model: nn.Module) -> dict[str, str]:
    """attnlab keys -> transformers keys."""
    return layer_key_map(model, _PARTS, final_norm="embedding_norm")


def _check(c: DecoderConfig) -> list[str]:
    """transformers' ``layer_types`` for ``c``, or ValueError naming what LFM2 cannot hold."""
    specs = c.layer_specs
    if any(s.mixer not in ("attention", "short_conv") or s.ffn != "dense" for s in specs):
        raise ValueError(
            "LFM2 has short-convolution or attention layers, each with a dense feed-forward; "
            f"got {[(s.mixer, s.ffn) for s in specs]}"
        )
    convs = linear_settings(c, "short_conv")
    if len({(x.conv_kernel, x.conv_bias) for x in convs}) > 1:
        raise ValueError("LFM2 has one convolution width and bias setting for every layer")
    if (
        c.position_embedding != "rope"
        or c.norm != "rmsnorm"
        or c.mlp != "gated"
        or not (c.qk_norm and c.qk_norm_scope == "head")
        or c.attention_bias
        or c.mlp_bias
        or c.head_dim != c.hidden_size // c.num_attention_heads
    ):
        raise ValueError(
            "LFM2 is RoPE + RMSNorm + gated MLP, per-head QK-norm, no biases and head_dim = "
            "hidden_size / num_attention_heads"
        )
    return [FULL if s.mixer == "attention" else CONV for s in specs]


def lfm2_to_hf(model: nn.Module) -> nn.Module:
    assert isinstance(model, DecoderLM)
    c = model.config
    types = _check(c)
    conv = next((s.linear for s in c.layer_specs if s.mixer == "short_conv"), None)
    conv = conv or LinearLayerConfig(conv_kernel=3)
    tf = require_transformers()
    cfg = tf.Lfm2Config(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        block_auto_adjust_ff_dim=False,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        max_position_embeddings=c.max_position_embeddings,
        norm_eps=c.norm_eps,
        rope_parameters=rope_to_hf(c),
        tie_word_embeddings=c.tie_word_embeddings,
        conv_L_cache=conv.conv_kernel,
        conv_bias=conv.conv_bias,
        layer_types=types,
        **special_tokens_to_hf(c),
    )
    return tf.Lfm2ForCausalLM(cfg)


LFM2 = hybrid_converter(
    model_type="lfm2",
    hf_class="Lfm2ForCausalLM",
    config_from_hf=lfm2_config,
    key_map=key_map,
    to_hf_model=lfm2_to_hf,
    mixer="short_conv",
)
