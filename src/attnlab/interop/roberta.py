"""RoBERTa, XLM-RoBERTa and DistilBERT <-> :class:`attnlab.models.EncoderModel`.

* RoBERTa (Liu et al., 2019) and XLM-RoBERTa (Conneau et al., 2020): BERT's layers and key
  names; positions count from ``padding_idx + 1`` over the real tokens
  (``padding_idx + cumsum(mask) * mask``: ``position_embedding_type="roberta"``), one token
  type in practice.
* DistilBERT (Sanh et al., 2019): BERT's post-LN layers under other names
  (``q_lin``... ``sa_layer_norm``, ``ffn.lin1``), learned positions from 0, no token-type
  embeddings and no pooler.

Folders with sentence-transformers' files get ``encode``'s pooling settings, as BERT's do.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from attnlab.interop.bert import _FIELDS
from attnlab.interop.bert import key_map as bert_key_map
from attnlab.interop.hf import (
    Converter,
    per_layer_keys,
    register_converter,
    require_transformers,
)
from attnlab.interop.sentence_transformers import attach_sentence_settings
from attnlab.models.config import EncoderConfig
from attnlab.models.encoder import EncoderModel

__all__ = ["DISTILBERT", "ROBERTA", "XLM_ROBERTA"]


def _roberta_config(model_type: str) -> Any:
    def config_from_hf(cfg: dict[str, Any], weight_names: set[str]) -> EncoderConfig:
        pos = cfg.get("position_embedding_type", "absolute")
        if pos != "absolute":
            raise ValueError(
                f"{model_type} with position_embedding_type={pos!r} is not supported; attnlab "
                "converts 'absolute' (RoBERTa's positions from padding_idx + 1)"
            )
        if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
            raise ValueError(f"{model_type} configured as a decoder is not supported")
        kwargs = {k: cfg[k] for k in _FIELDS if k in cfg}
        return EncoderConfig(
            norm_position="post",
            position_embedding_type="roberta",
            add_pooler="pooler.dense.weight" in weight_names,
            model_type=model_type,
            **kwargs,
        )

    return config_from_hf


def _roberta_to_hf(model_type: str) -> Any:
    def to_hf_model(model: nn.Module) -> nn.Module:
        assert isinstance(model, EncoderModel)
        c = model.config
        if c.position_embedding_type != "roberta" or c.attention_window is not None:
            raise ValueError(
                f"{model_type} has RoBERTa's learned positions and full attention; this "
                f"EncoderModel has position_embedding_type={c.position_embedding_type!r}, "
                f"attention_window={c.attention_window!r}"
            )
        if c.norm_position != "post" or c.num_key_value_heads != c.num_attention_heads:
            raise ValueError(f"{model_type} is post-LN multi-head attention")
        tf = require_transformers()
        kwargs = {k: getattr(c, k) for k in _FIELDS}
        if model_type == "roberta":
            return tf.RobertaModel(tf.RobertaConfig(**kwargs), add_pooling_layer=c.add_pooler)
        cfg = tf.XLMRobertaConfig(**kwargs)
        return tf.XLMRobertaModel(cfg, add_pooling_layer=c.add_pooler)

    return to_hf_model


def _is_roberta(m: nn.Module, model_type: str) -> bool:
    if not isinstance(m, EncoderModel) or m.config.attention_window is not None:
        return False
    named = m.config.model_type
    if named is not None:
        return named == model_type
    return model_type == "roberta" and m.config.position_embedding_type == "roberta"


def _roberta(model_type: str, hf_class: str, prefix: str) -> Converter:
    return register_converter(
        Converter(
            model_type=model_type,
            hf_classes={hf_class: ""},
            base_prefix=prefix,
            attnlab_class=EncoderModel,
            config_from_hf=_roberta_config(model_type),
            build=EncoderModel,
            key_map=bert_key_map,
            to_hf_model=_roberta_to_hf(model_type),
            folder_extras=attach_sentence_settings,
            accepts=lambda m: _is_roberta(m, model_type),
        )
    )


ROBERTA = _roberta("roberta", "RobertaModel", "roberta.")
XLM_ROBERTA = _roberta("xlm-roberta", "XLMRobertaModel", "roberta.")


def distilbert_config(cfg: dict[str, Any], weight_names: set[str]) -> EncoderConfig:
    return EncoderConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["dim"],
        num_hidden_layers=cfg["n_layers"],
        num_attention_heads=cfg["n_heads"],
        intermediate_size=cfg["hidden_dim"],
        hidden_act=cfg.get("activation", "gelu"),
        hidden_dropout_prob=float(cfg.get("dropout", 0.1)),
        attention_probs_dropout_prob=float(cfg.get("attention_dropout", 0.1)),
        max_position_embeddings=cfg.get("max_position_embeddings", 512),
        type_vocab_size=0,
        layer_norm_eps=1e-12,
        pad_token_id=cfg.get("pad_token_id", 0),
        norm_position="post",
        add_pooler=False,
        model_type="distilbert",
    )


def distilbert_key_map(model: nn.Module) -> dict[str, str]:
    assert isinstance(model, EncoderModel)
    m = {
        "embeddings.word_embeddings.weight": "embeddings.word_embeddings.weight",
        "embeddings.position_embeddings.weight": "embeddings.position_embeddings.weight",
        "embeddings.norm.weight": "embeddings.LayerNorm.weight",
        "embeddings.norm.bias": "embeddings.LayerNorm.bias",
    }
    parts = {
        "attention.q_proj": "attention.q_lin",
        "attention.k_proj": "attention.k_lin",
        "attention.v_proj": "attention.v_lin",
        "attention.out_proj": "attention.out_lin",
        "attn_norm": "sa_layer_norm",
        "feed_forward.fc_in": "ffn.lin1",
        "feed_forward.fc_out": "ffn.lin2",
        "ffn_norm": "output_layer_norm",
    }
    return m | per_layer_keys(len(model.layers), parts, "transformer.layer")


def distilbert_to_hf(model: nn.Module) -> nn.Module:
    assert isinstance(model, EncoderModel)
    c = model.config
    if (
        c.position_embedding_type != "absolute"
        or c.attention_window is not None
        or c.type_vocab_size
        or c.add_pooler
        or c.norm_position != "post"
        or c.layer_norm_eps != 1e-12
        or c.num_key_value_heads != c.num_attention_heads
    ):
        raise ValueError(
            "DistilBERT is post-LN multi-head attention with learned positions from 0, no "
            "token types, no pooler and LayerNorm eps 1e-12"
        )
    tf = require_transformers()
    cfg = tf.DistilBertConfig(
        vocab_size=c.vocab_size,
        dim=c.hidden_size,
        n_layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads,
        hidden_dim=c.intermediate_size,
        activation=c.hidden_act,
        dropout=c.hidden_dropout_prob,
        attention_dropout=c.attention_probs_dropout_prob,
        max_position_embeddings=c.max_position_embeddings,
        pad_token_id=c.pad_token_id,
    )
    return tf.DistilBertModel(cfg)


DISTILBERT = register_converter(
    Converter(
        model_type="distilbert",
        hf_classes={"DistilBertModel": ""},
        base_prefix="distilbert.",
        attnlab_class=EncoderModel,
        config_from_hf=distilbert_config,
        build=EncoderModel,
        key_map=distilbert_key_map,
        to_hf_model=distilbert_to_hf,
        folder_extras=attach_sentence_settings,
        accepts=lambda m: isinstance(m, EncoderModel) and m.config.model_type == "distilbert",
    )
)
