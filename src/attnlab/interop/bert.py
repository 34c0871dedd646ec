"""BERT (``model_type == "bert"``) <-> :class:`attnlab.models.EncoderModel`."""

from __future__ import annotations

from typing import Any

from torch import nn

from attnlab.interop.hf import (
    Converter,
    per_layer_keys,
    register_converter,
    require_transformers,
)
from attnlab.interop.sentence_transformers import attach_sentence_settings
from attnlab.models.config import EncoderConfig
from attnlab.models.encoder import EncoderModel

_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "hidden_act",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "max_position_embeddings",
    "type_vocab_size",
    "layer_norm_eps",
    "pad_token_id",
)


def config_from_hf(cfg: dict[str, Any], weight_names: set[str]) -> EncoderConfig:
    pos = cfg.get("position_embedding_type", "absolute")
    if pos != "absolute":
        raise ValueError(
            f"BERT with position_embedding_type={pos!r} is not supported; attnlab converts 'absolute'"
        )
    if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
        raise ValueError(
            "BERT configured as a decoder (is_decoder/add_cross_attention) is not supported"
        )
    kwargs = {k: cfg[k] for k in _FIELDS if k in cfg}
    kwargs["add_pooler"] = "pooler.dense.weight" in weight_names
    return EncoderConfig(norm_position="post", **kwargs)


def key_map(model: nn.Module) -> dict[str, str]:
    assert isinstance(model, EncoderModel)
    m = {
        "embeddings.word_embeddings.weight": "embeddings.word_embeddings.weight",
        "embeddings.position_embeddings.weight": "embeddings.position_embeddings.weight",
        "embeddings.norm.weight": "embeddings.LayerNorm.weight",
        "embeddings.norm.bias": "embeddings.LayerNorm.bias",
    }
    if model.embeddings.token_type_embeddings is not None:
        m["embeddings.token_type_embeddings.weight"] = "embeddings.token_type_embeddings.weight"
    parts = {
        "attention.q_proj": "attention.self.query",
        "attention.k_proj": "attention.self.key",
        "attention.v_proj": "attention.self.value",
        "attention.out_proj": "attention.output.dense",
        "attn_norm": "attention.output.LayerNorm",
        "feed_forward.fc_in": "intermediate.dense",
        "feed_forward.fc_out": "output.dense",
        "ffn_norm": "output.LayerNorm",
    }
    m |= per_layer_keys(len(model.layers), parts, "encoder.layer")
    if model.pooler is not None:
        m["pooler.dense.weight"] = "pooler.dense.weight"
        m["pooler.dense.bias"] = "pooler.dense.bias"
    return m


def to_hf_model(model: nn.Module) -> nn.Module:
    assert isinstance(model, EncoderModel)
    c = model.config
    if c.position_embedding_type != "absolute" or c.attention_window is not None:
        raise ValueError(
            "BERT has learned absolute positions and full attention; this EncoderModel has "
            f"position_embedding_type={c.position_embedding_type!r}, "
            f"attention_window={c.attention_window!r}"
        )
    if c.norm_position != "post":
        raise ValueError("BERT is post-LN; a pre-LN EncoderModel has no transformers equivalent")
    if c.num_key_value_heads != c.num_attention_heads:
        raise ValueError(
            f"BERT has no grouped-query attention (num_key_value_heads={c.num_key_value_heads} "
            f"!= num_attention_heads={c.num_attention_heads})"
        )
    tf = require_transformers()
    hf_config = tf.BertConfig(**{k: getattr(c, k) for k in _FIELDS})
    return tf.BertModel(hf_config, add_pooling_layer=c.add_pooler)


BERT = register_converter(
    Converter(
        model_type="bert",
        hf_classes={"BertModel": ""},
        base_prefix="bert.",
        attnlab_class=EncoderModel,
        config_from_hf=config_from_hf,
        build=EncoderModel,
        key_map=key_map,
        to_hf_model=to_hf_model,
        folder_extras=attach_sentence_settings,
        accepts=lambda m: (
            isinstance(m, EncoderModel)
            and m.config.model_type in (None, "bert")
            and m.config.attention_window is None
            and m.config.position_embedding_type == "absolute"
        ),
    )
)
