"""BLOOM (``model_type == "bloom"``) <-> :class:`DecoderLM` with ALiBi.

BLOOM fuses q, k and v per head: ``query_key_value`` rows are ordered
``[head, (q|k|v), head_dim]``; the conversion splits them into three projections.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnlab.interop.hf import (
    Converter,
    per_layer_keys,
    register_converter,
    require_transformers,
)
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig


def config_from_hf(cfg: dict[str, Any], weight_names: set[str]) -> DecoderConfig:
    if cfg.get("apply_residual_connection_post_layernorm"):
        raise ValueError(
            "BLOOM with apply_residual_connection_post_layernorm=True is not supported"
        )
    if cfg.get("pretraining_tp", 1) > 1 and cfg.get("slow_but_exact"):
        raise ValueError("BLOOM with slow_but_exact tensor-parallel emulation is not supported")
    d = cfg.get("hidden_size") or cfg["n_embed"]
    return DecoderConfig.bloom(
        vocab_size=cfg["vocab_size"],
        hidden_size=d,
        num_hidden_layers=cfg.get("n_layer") or cfg["num_hidden_layers"],
        num_attention_heads=cfg.get("n_head") or cfg["num_attention_heads"],
        intermediate_size=4 * d,
        norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
        # ALiBi has no position table; generation only needs a length limit.
        max_position_embeddings=cfg.get("seq_length") or 2048,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        attention_dropout=cfg.get("attention_dropout", 0.0),
        hidden_dropout=cfg.get("hidden_dropout", 0.0),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"),
        pad_token_id=cfg.get("pad_token_id"),
    )


def key_map(model: nn.Module) -> dict[str, str]:
    assert isinstance(model, DecoderLM)
    assert model.embed_norm is not None
    m = {
        "embed_tokens.weight": "transformer.word_embeddings.weight",
        "embed_norm.weight": "transformer.word_embeddings_layernorm.weight",
        "embed_norm.bias": "transformer.word_embeddings_layernorm.bias",
        "norm.weight": "transformer.ln_f.weight",
        "norm.bias": "transformer.ln_f.bias",
    }
    if model.lm_head is not None:
        m["lm_head.weight"] = "lm_head.weight"
    parts = {
        "self_attention.q_proj": "self_attention.query_key_value.q",
        "self_attention.k_proj": "self_attention.query_key_value.k",
        "self_attention.v_proj": "self_attention.query_key_value.v",
        "self_attention.out_proj": "self_attention.dense",
        "feed_forward.fc_in": "mlp.dense_h_to_4h",
        "feed_forward.fc_out": "mlp.dense_4h_to_h",
        "self_attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    return m | per_layer_keys(len(model.layers), parts, "transformer.h")


def weights_from_hf(weights: dict[str, Tensor], config: DecoderConfig) -> dict[str, Tensor]:
    """Split ``query_key_value`` per head into q/k/v; drop a tied head copy."""
    h, hd = config.num_attention_heads, config.head_dim
    assert hd is not None
    out: dict[str, Tensor] = {}
    for k, v in weights.items():
        if k == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if ".query_key_value." in k:
            name, kind = k.rsplit(".", 1)
            per_head = v.reshape(h, 3, hd, *v.shape[1:])  # [H, 3, h_d, (D)]
            for j, part in enumerate("qkv"):
                out[f"{name}.{part}.{kind}"] = per_head[:, j].reshape(h * hd, *v.shape[1:])
            continue
        out[k] = v
    return out


def weights_to_hf(weights: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """The inverse of :func:`weights_from_hf`."""
    assert isinstance(model, DecoderLM)
    c = model.config
    h, hd = c.num_attention_heads, c.head_dim
    assert hd is not None
    out: dict[str, Tensor] = {}
    for k, v in weights.items():
        if ".query_key_value." not in k:
            out[k] = v
            continue
        name, kind = k.rsplit(".", 1)
        if not name.endswith(".q"):
            continue
        base = name[:-2]
        parts = [weights[f"{base}.{p}.{kind}"] for p in "qkv"]
        stacked = torch.stack(
            [t.reshape(h, hd, *t.shape[1:]) for t in parts], dim=1
        )  # [H,3,h_d,(D)]
        out[f"{base}.{kind}"] = stacked.reshape(3 * h * hd, *parts[0].shape[1:])
    if model.lm_head is None:
        out["lm_head.weight"] = model.embed_tokens.weight.detach()
    return out


def to_hf_model(model: nn.Module) -> nn.Module:
    assert isinstance(model, DecoderLM)
    c = model.config
    if (
        c.num_key_value_heads != c.num_attention_heads
        or c.intermediate_size != 4 * c.hidden_size
        or not c.embedding_norm
        or c.norm != "layernorm"
    ):
        raise ValueError(
            "BLOOM is multi-head attention, a 4x MLP and LayerNorms (also after the embeddings); "
            f"got num_key_value_heads={c.num_key_value_heads}, intermediate_size="
            f"{c.intermediate_size}, embedding_norm={c.embedding_norm}, norm={c.norm!r}"
        )
    tf = require_transformers()
    cfg = tf.BloomConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        n_layer=c.num_hidden_layers,
        n_head=c.num_attention_heads,
        layer_norm_epsilon=c.norm_eps,
        hidden_dropout=c.hidden_dropout,
        attention_dropout=c.attention_dropout,
        tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        pad_token_id=c.pad_token_id,
        seq_length=c.max_position_embeddings,
    )
    return tf.BloomForCausalLM(cfg)


BLOOM = register_converter(
    Converter(
        model_type="bloom",
        hf_classes={"BloomForCausalLM": ""},
        attnlab_class=DecoderLM,
        config_from_hf=config_from_hf,
        build=DecoderLM,
        key_map=key_map,
        to_hf_model=to_hf_model,
        weights_from_hf=weights_from_hf,
        weights_to_hf=weights_to_hf,
        accepts=lambda m: isinstance(m, DecoderLM) and m.config.position_embedding == "alibi",
    )
)
