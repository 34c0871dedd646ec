"""Bamba (``model_type == "bamba"``) <-> :class:`DecoderLM` with a Mamba-2 hybrid layout.

IBM, Princeton, CMU and UIUC (2024), Bamba: Mamba-2 layers with GQA attention at
``attn_layer_indices``, each followed by a SwiGLU feed-forward. In attnlab that is a
``DecoderConfig.layers`` layout of ``LayerSpec(mixer="mamba2" | "attention")``; one
:class:`~attnlab.cache.base.ModelCache` holds a KV cache per attention layer and a
:class:`~attnlab.cache.recurrent.Mamba2State` per Mamba-2 layer.

What maps to what: the Mamba-2 mixer keeps transformers' names (``in_proj``, ``conv1d``,
``dt_bias``, ``A_log``, ``D``, the gate-then-normalise ``norm`` over ``n_groups`` groups,
``out_proj``); attention is Llama's with RoPE on half of each head (Bamba hard-codes
``partial_rotary_factor = 0.5``); the norms are ``input_layernorm``, ``pre_ff_layernorm``
and ``final_layernorm``.
"""

from __future__ import annotations

import math
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

__all__ = ["BAMBA"]

# attnlab sub-module path -> transformers sub-module path, within one layer
_PARTS = {
    "self_attn_norm": "input_layernorm",
    "ffn_norm": "pre_ff_layernorm",
    "self_attention.q_proj": "self_attn.q_proj",
    "self_attention.k_proj": "self_attn.k_proj",
    "self_attention.v_proj": "self_attn.v_proj",
    "self_attention.out_proj": "self_attn.o_proj",
    "self_attention.mixer": "mamba",  # every Mamba-2 parameter keeps its transformers name
    "feed_forward.gate_proj": "feed_forward.gate_proj",
    "feed_forward.up_proj": "feed_forward.up_proj",
    "feed_forward.down_proj": "feed_forward.down_proj",
}


def _number(v: Any) -> float:
    """A float, or transformers' JSON spelling of a non-finite one (``{"__float__": "Infinity"}``)."""
    if isinstance(v, dict) and "__float__" in v:
        return float(v["__float__"])
    return float(v)


def bamba_config(cfg: dict[str, Any], weight_names: set[str]) -> DecoderConfig:
    """The attnlab config of a transformers ``BambaConfig`` (as a dict)."""
    n, d, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    width = int(cfg.get("mamba_expand", 2) * d)
    m_heads = int(cfg.get("mamba_n_heads", 128))
    m_dim = cfg.get("mamba_d_head", "auto")
    m_dim = width // m_heads if m_dim in (None, "auto") else int(m_dim)
    limit = tuple(_number(v) for v in (cfg.get("time_step_limit") or (0.0, math.inf)))
    mamba = LinearLayerConfig(
        width=width,
        num_heads=m_heads,
        head_dim=m_dim,
        state_size=int(cfg.get("mamba_d_state", 256)),
        n_groups=int(cfg.get("mamba_n_groups", 1)),
        conv_kernel=int(cfg.get("mamba_d_conv", 4)),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        dt_limit=None if tuple(limit) == (0.0, math.inf) else (limit[0], limit[1]),
        chunk_size=int(cfg.get("mamba_chunk_size", 256)),
    )
    attn = set(cfg.get("attn_layer_indices") or [])
    layers = tuple(
        LayerSpec() if i in attn else LayerSpec(mixer="mamba2", linear=mamba) for i in range(n)
    )
    cfg = dict(cfg)
    params = dict(cfg.get("rope_parameters") or {})
    params.pop("partial_rotary_factor", None)  # always 0.5 in Bamba
    cfg["rope_parameters"] = params or None
    theta, scaling = rope_from_hf(cfg)
    return DecoderConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=d,
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=d // heads,
        intermediate_size=cfg["intermediate_size"],
        hidden_act=cfg.get("hidden_act", "silu"),
        norm_eps=cfg.get("rms_norm_eps", 1e-5),
        max_position_embeddings=cfg.get("max_position_embeddings", 262144),
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=0.5,
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        attention_dropout=float(cfg.get("attention_dropout", 0.0) or 0.0),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        **special_tokens(cfg),
        layers=layers,
        model_type="bamba",
    )


def key_map(model: nn.Module) -> dict[str, str]:
    """attnlab keys -> transformers keys."""
    return layer_key_map(model, _PARTS, final_norm="final_layernorm")


def bamba_to_hf(model: nn.Module) -> nn.Module:
    assert isinstance(model, DecoderLM)
    c = model.config
    specs = c.layer_specs
    if any(s.mixer not in ("attention", "mamba2") or s.ffn != "dense" for s in specs):
        raise ValueError(
            "Bamba has Mamba-2 or attention layers, each with a dense feed-forward; got "
            f"{[(s.mixer, s.ffn) for s in specs]}"
        )
    mambas = linear_settings(c, "mamba2")
    if len(mambas) != 1:
        raise ValueError("Bamba has one Mamba-2 setting for every Mamba-2 layer")
    mb = mambas.pop()
    if (
        c.norm != "rmsnorm"
        or c.mlp != "gated"
        or c.position_embedding != "rope"
        or c.partial_rotary_factor != 0.5
        or c.qk_norm
        or c.sliding_window is not None
        or c.head_dim != c.hidden_size // c.num_attention_heads
        or (c.attention_out_bias is not None and c.attention_out_bias != c.attention_bias)
    ):
        raise ValueError(
            "Bamba is RMSNorm + gated MLPs, global attention with RoPE on half of each head, "
            "no QK-norm, head_dim = hidden_size / num_attention_heads"
        )
    width = mb.width or 2 * c.hidden_size
    if width % c.hidden_size:
        raise ValueError(f"Bamba's Mamba-2 width is mamba_expand x hidden_size, got {width}")
    p = mb.head_dim or 64
    tf = require_transformers()
    cfg = tf.BambaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        hidden_act=c.hidden_act,
        rms_norm_eps=c.norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        rope_parameters=rope_to_hf(c),
        attention_bias=c.attention_bias,
        mlp_bias=c.mlp_bias,
        attention_dropout=c.attention_dropout,
        tie_word_embeddings=c.tie_word_embeddings,
        attn_layer_indices=[i for i, s in enumerate(specs) if s.mixer == "attention"],
        mamba_n_heads=mb.num_heads or width // p,
        mamba_d_head=p,
        mamba_n_groups=mb.n_groups,
        mamba_d_state=mb.state_size,
        mamba_d_conv=mb.conv_kernel,
        mamba_expand=width // c.hidden_size,
        mamba_chunk_size=mb.chunk_size,
        mamba_conv_bias=mb.conv_bias,
        mamba_proj_bias=mb.proj_bias,
        time_step_limit=mb.dt_limit if mb.dt_limit is not None else (0.0, math.inf),
        **special_tokens_to_hf(c),
    )
    return tf.BambaForCausalLM(cfg)


BAMBA = hybrid_converter(
    model_type="bamba",
    hf_class="BambaForCausalLM",
    config_from_hf=bamba_config,
    key_map=key_map,
    to_hf_model=bamba_to_hf,
    mixer="mamba2",
)
