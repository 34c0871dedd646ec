"""Llama (``model_type == "llama"``) and Mistral (``"mistral"``) <-> :class:`DecoderLM`.

Both are RoPE + RMSNorm + SwiGLU + GQA decoders; Mistral adds a sliding window.
RoPE settings are read from transformers 5's ``rope_parameters`` (or the older
``rope_theta``/``rope_scaling`` of a saved ``config.json``).
"""

from __future__ import annotations

from collections.abc import Callable, Container
from typing import Any

from torch import Tensor, nn

from attnlab.interop.hf import (
    Converter,
    per_layer_keys,
    register_converter,
    require_transformers,
)
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.layout import LayerSpec

_UNSUPPORTED_ROPE_KEYS = ("partial_rotary_factor",)


def rope_from_hf(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, scaling or None)`` from a transformers config dict."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None)
    if theta is None:  # absent (or null): transformers' default; any value given is checked
        theta = cfg.get("rope_theta")
    if theta is None:
        theta = 10000.0
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    for key in _UNSUPPORTED_ROPE_KEYS:
        if params.get(key, 1.0) != 1.0:
            raise ValueError(f"RoPE with {key}={params[key]} is not supported")
        params.pop(key, None)
    rope_type = params.get("rope_type", "default")
    return theta, (None if rope_type == "default" else params)


def rope_to_hf(config: DecoderConfig) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "default"} | dict(config.rope_scaling or {})
    params["rope_theta"] = config.rope_theta
    return params


def decoder_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The :class:`DecoderConfig` fields every Llama-family config spells alike."""
    theta, scaling = rope_from_hf(cfg)
    heads = cfg["num_attention_heads"]
    return dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg["intermediate_size"],
        hidden_act=cfg.get("hidden_act", "silu"),
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_dropout=float(cfg.get("attention_dropout", 0.0) or 0.0),
        pad_token_id=cfg.get("pad_token_id"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=_first(cfg.get("eos_token_id")),
    )


def config_from_hf(cfg: dict[str, Any], weight_names: set[str]) -> DecoderConfig:
    window = cfg.get("sliding_window") if cfg.get("model_type") == "mistral" else None
    return DecoderConfig.llama(
        **decoder_fields(cfg),
        sliding_window=window,
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
    )


def _first(tok: Any) -> int | None:
    return tok[0] if isinstance(tok, list) and tok else tok


def key_map(model: nn.Module, present: Container[str] | None = None) -> dict[str, str]:
    """attnlab name -> transformers name of every weight ``present`` (default: the model's
    state dict; the GGUF writer adds the ``.weight`` of quantized layers)."""
    assert isinstance(model, DecoderLM)
    m = {"embed_tokens.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if model.lm_head is not None:
        m["lm_head.weight"] = "lm_head.weight"
    parts = {
        "self_attention.q_proj": "self_attn.q_proj",
        "self_attention.k_proj": "self_attn.k_proj",
        "self_attention.v_proj": "self_attn.v_proj",
        "self_attention.out_proj": "self_attn.o_proj",
        "feed_forward.gate_proj": "mlp.gate_proj",
        "feed_forward.up_proj": "mlp.up_proj",
        "feed_forward.down_proj": "mlp.down_proj",
        "self_attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    return m | per_layer_keys(
        len(model.layers),
        parts,
        "model.layers",
        present=model.state_dict() if present is None else present,
    )


def drop_tied_head(weights: dict[str, Tensor], config: DecoderConfig) -> dict[str, Tensor]:
    """Tied checkpoints may carry ``lm_head.weight``, a copy of the embeddings: drop it."""
    if config.tie_word_embeddings:
        return {k: v for k, v in weights.items() if k != "lm_head.weight"}
    return weights


def _check_convertible(c: DecoderConfig, arch: str) -> None:
    if c.position_embedding != "rope" or c.norm != "rmsnorm" or c.mlp != "gated":
        raise ValueError(
            f"{arch} is RoPE + RMSNorm + gated MLP; this DecoderLM has position_embedding="
            f"{c.position_embedding!r}, norm={c.norm!r}, mlp={c.mlp!r}"
        )
    if c.rope_convention != "half":
        raise ValueError(f"{arch} uses rotate-half RoPE, got rope_convention={c.rope_convention!r}")
    if (c.attention_out_bias if c.attention_out_bias is not None else c.attention_bias) != (
        c.attention_bias
    ):
        raise ValueError(f"{arch} has the same bias setting on q/k/v and o projections")


def _hf_kwargs(c: DecoderConfig) -> dict[str, Any]:
    return dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        intermediate_size=c.intermediate_size,
        hidden_act=c.hidden_act,
        rms_norm_eps=c.norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        rope_parameters=rope_to_hf(c),
        tie_word_embeddings=c.tie_word_embeddings,
        attention_dropout=c.attention_dropout,
        pad_token_id=c.pad_token_id,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
    )


def llama_to_hf(model: nn.Module) -> nn.Module:
    assert isinstance(model, DecoderLM)
    c = model.config
    _check_convertible(c, "Llama")
    tf = require_transformers()
    cfg = tf.LlamaConfig(**_hf_kwargs(c), attention_bias=c.attention_bias, mlp_bias=c.mlp_bias)
    return tf.LlamaForCausalLM(cfg)


def mistral_to_hf(model: nn.Module) -> nn.Module:
    assert isinstance(model, DecoderLM)
    c = model.config
    _check_convertible(c, "Mistral")
    if c.attention_bias or c.mlp_bias:
        raise ValueError("Mistral has no attention or MLP biases")
    tf = require_transformers()
    cfg = tf.MistralConfig(**_hf_kwargs(c), sliding_window=c.sliding_window)
    return tf.MistralForCausalLM(cfg)


def add_tied_head(weights: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    assert isinstance(model, DecoderLM)
    if model.lm_head is None:
        weights = dict(weights)
        weights["lm_head.weight"] = model.embed_tokens.weight.detach()
    return weights


def claims(model: Any, model_type: str, infer: Callable[[DecoderConfig], bool]) -> bool:
    """Whether ``to_hf`` converts ``model`` to ``model_type``: the config's ``model_type``
    when it names one, else ``infer(config)`` from its components."""
    if not isinstance(model, DecoderLM):
        return False
    named = model.config.model_type
    return named == model_type if named is not None else infer(model.config)


def _plain_rope(c: DecoderConfig, *, windowed: bool) -> bool:
    if c.position_embedding != "rope" or c.qk_norm or c.norm_placement != "pre":
        return False
    if any(spec != LayerSpec() for spec in c.layer_specs):
        return False  # MoE layers, per-layer windows: interop/moe.py, interop/qwen.py
    if c.attention_out_bias is not None and c.attention_out_bias != c.attention_bias:
        return False  # Qwen2's biases on q/k/v only
    return (c.sliding_window is not None) == windowed


def _rope_model(model: Any, *, windowed: bool) -> bool:
    return claims(
        model, "mistral" if windowed else "llama", lambda c: _plain_rope(c, windowed=windowed)
    )


LLAMA = register_converter(
    Converter(
        model_type="llama",
        hf_classes={"LlamaForCausalLM": ""},
        attnlab_class=DecoderLM,
        config_from_hf=config_from_hf,
        build=DecoderLM,
        key_map=key_map,
        to_hf_model=llama_to_hf,
        weights_from_hf=drop_tied_head,
        weights_to_hf=add_tied_head,
        accepts=lambda m: _rope_model(m, windowed=False),
    )
)

MISTRAL = register_converter(
    Converter(
        model_type="mistral",
        hf_classes={"MistralForCausalLM": ""},
        attnlab_class=DecoderLM,
        config_from_hf=config_from_hf,
        build=DecoderLM,
        key_map=key_map,
        to_hf_model=mistral_to_hf,
        weights_from_hf=drop_tied_head,
        weights_to_hf=add_tied_head,
        accepts=lambda m: _rope_model(m, windowed=True),
    )
)
