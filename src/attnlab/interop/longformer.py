"""Longformer (``model_type == "longformer"``) <-> :class:`attnlab.models.EncoderModel`.

transformers' ``LongformerModel`` is RoBERTa's encoder (positions counted from
``pad_token_id + 1``) whose self-attention is a sliding window of
``attention_window // 2`` keys on either side plus global tokens with their own
``query_global``/``key_global``/``value_global`` projections (Beltagy et al., 2020).
attnlab builds it as an ``EncoderModel`` with ``attention_window`` set and
``position_embedding_type="roberta"``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from attnlab.interop.hf import Converter, per_layer_keys, register_converter, require_transformers
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
    window = cfg.get("attention_window", 512)
    kwargs = {k: cfg[k] for k in _FIELDS if k in cfg}
    kwargs["add_pooler"] = "pooler.dense.weight" in weight_names
    return EncoderConfig(
        norm_position="post",
        position_embedding_type="roberta",
        attention_window=tuple(window) if isinstance(window, list | tuple) else int(window),
        **kwargs,
    )


def key_map(model: nn.Module) -> dict[str, str]:
    assert isinstance(model, EncoderModel)
    m = {
        "embeddings.word_embeddings.weight": "embeddings.word_embeddings.weight",
        "embeddings.position_embeddings.weight": "embeddings.position_embeddings.weight",
        "embeddings.token_type_embeddings.weight": "embeddings.token_type_embeddings.weight",
        "embeddings.norm.weight": "embeddings.LayerNorm.weight",
        "embeddings.norm.bias": "embeddings.LayerNorm.bias",
    }
    parts = {
        "attention.q_proj": "attention.self.query",
        "attention.k_proj": "attention.self.key",
        "attention.v_proj": "attention.self.value",
        "attention.q_global": "attention.self.query_global",
        "attention.k_global": "attention.self.key_global",
        "attention.v_global": "attention.self.value_global",
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


def _is_longformer(model: nn.Module) -> bool:
    return (
        isinstance(model, EncoderModel)
        and model.config.attention_window is not None
        and model.config.position_embedding_type == "roberta"
    )


def to_hf_model(model: nn.Module) -> nn.Module:
    assert isinstance(model, EncoderModel)
    c = model.config
    if c.norm_position != "post":
        raise ValueError(
            "Longformer is post-LN; a pre-LN EncoderModel has no transformers equivalent"
        )
    if c.type_vocab_size < 1:
        raise ValueError("transformers' Longformer always has token types (type_vocab_size >= 1)")
    tf = require_transformers()
    window = c.attention_window
    assert window is not None
    hf_config = tf.LongformerConfig(
        attention_window=list(window) if isinstance(window, tuple) else window,
        **{k: getattr(c, k) for k in _FIELDS},
    )
    return tf.LongformerModel(hf_config, add_pooling_layer=c.add_pooler)


LONGFORMER = register_converter(
    Converter(
        model_type="longformer",
        hf_classes={"LongformerModel": ""},
        base_prefix="longformer.",
        attnlab_class=EncoderModel,
        config_from_hf=config_from_hf,
        build=EncoderModel,
        key_map=key_map,
        to_hf_model=to_hf_model,
        accepts=_is_longformer,
    )
)
