"""ModernBERT (``model_type == "modernbert"``) <-> :class:`attnlab.models.EncoderModel`.

ModernBERT (Warner et al., 2024) is a pre-LN encoder with RoPE, GeGLU, no biases and a
final norm; every ``global_attn_every_n_layers``-th layer (0, 3, 6, ...) attends
globally, the others to ``local_attention`` keys (``|i - j| <= local_attention // 2``:
a two-sided ``sliding_window`` pattern) with a RoPE base of their own. Its first layer
has no attention norm (the embeddings' norm serves). ``Wqkv`` (query, key, value rows)
and ``Wi`` (GeGLU's input half, then its gate half) are fused in the checkpoint: a load
and save layout, split into attnlab's projections on the way in.

Unpadded execution is the encoder's own: ``EncoderModel(..., unpad=True)`` packs the
real tokens of a padded batch into rows with a ``document`` pattern (positions restart
per row) and computes no padding.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.interop.hf import (
    Converter,
    per_layer_keys,
    register_converter,
    require_transformers,
)
from attnlab.interop.sentence_transformers import attach_sentence_settings
from attnlab.models.config import EncoderConfig
from attnlab.models.encoder import EncoderModel

__all__ = ["MODERNBERT"]

SLIDING, FULL = "sliding_attention", "full_attention"
_WQKV = re.compile(r"^(?P<layer>layers\.\d+)\.attn\.Wqkv\.(?P<kind>weight|bias)$")
_WI = re.compile(r"^(?P<layer>layers\.\d+)\.mlp\.Wi\.(?P<kind>weight|bias)$")


def _rope(cfg: dict[str, Any], kind: str, fallback: str, default: float) -> float:
    params = (cfg.get("rope_parameters") or {}).get(kind) or {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"ModernBERT with a scaled RoPE ({params}) is not supported")
    return float(params.get("rope_theta", cfg.get(fallback, default)))


def config_from_hf(cfg: dict[str, Any], weight_names: set[str]) -> EncoderConfig:
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        every = cfg.get("global_attn_every_n_layers", 3)
        types = [SLIDING if i % every else FULL for i in range(n)]
    if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
        raise ValueError(f"layer_types must list {n} of {[SLIDING, FULL]}, got {types!r}")
    window = int(cfg.get("local_attention", 128))
    return EncoderConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_hidden_layers=n,
        num_attention_heads=cfg["num_attention_heads"],
        intermediate_size=cfg["intermediate_size"],
        hidden_act=cfg.get("hidden_activation", "gelu"),
        hidden_dropout_prob=float(cfg.get("mlp_dropout", 0.0) or 0.0),
        attention_probs_dropout_prob=float(cfg.get("attention_dropout", 0.0) or 0.0),
        max_position_embeddings=cfg.get("max_position_embeddings", 8192),
        type_vocab_size=0,
        layer_norm_eps=cfg.get("norm_eps", 1e-5),
        pad_token_id=cfg.get("pad_token_id"),
        norm_position="pre",
        add_pooler=False,
        position_embedding_type="rope",
        rope_theta=_rope(cfg, FULL, "global_rope_theta", 160000.0),
        local_rope_theta=_rope(cfg, SLIDING, "local_rope_theta", 10000.0),
        norm_bias=bool(cfg.get("norm_bias", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp="gated",
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        local_attention=tuple(window if t == SLIDING else None for t in types),
        first_attn_norm=False,
        model_type="modernbert",
    )


def split_fused(weights: dict[str, Tensor], config: EncoderConfig) -> dict[str, Tensor]:
    """``attn.Wqkv`` into query/key/value and ``mlp.Wi`` into its two halves."""
    out: dict[str, Tensor] = {}
    for key, t in weights.items():
        if m := _WQKV.match(key):
            for name, part in zip(("Wq", "Wk", "Wv"), t.chunk(3, dim=0)):
                out[f"{m['layer']}.attn.{name}.{m['kind']}"] = part
        elif m := _WI.match(key):
            for name, part in zip(("Wi_in", "Wi_gate"), t.chunk(2, dim=0)):
                out[f"{m['layer']}.mlp.{name}.{m['kind']}"] = part
        else:
            out[key] = t
    return out


def fuse(weights: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """The inverse of :func:`split_fused`."""
    out = dict(weights)
    for key in [k for k in out if re.search(r"\.attn\.Wq\.(weight|bias)$", k)]:
        head, kind = key.rsplit(".attn.Wq.", 1)
        parts = [out.pop(f"{head}.attn.{n}.{kind}") for n in ("Wq", "Wk", "Wv")]
        out[f"{head}.attn.Wqkv.{kind}"] = torch.cat(parts)
    for key in [k for k in out if re.search(r"\.mlp\.Wi_in\.(weight|bias)$", k)]:
        head, kind = key.rsplit(".mlp.Wi_in.", 1)
        parts = [out.pop(f"{head}.mlp.{n}.{kind}") for n in ("Wi_in", "Wi_gate")]
        out[f"{head}.mlp.Wi.{kind}"] = torch.cat(parts)
    return out


def key_map(model: nn.Module) -> dict[str, str]:
    assert isinstance(model, EncoderModel)
    m = {
        "embeddings.word_embeddings.weight": "embeddings.tok_embeddings.weight",
        "embeddings.norm.weight": "embeddings.norm.weight",
        "embeddings.norm.bias": "embeddings.norm.bias",
        "final_norm.weight": "final_norm.weight",
        "final_norm.bias": "final_norm.bias",
    }
    parts = {
        "attention.q_proj": "attn.Wq",
        "attention.k_proj": "attn.Wk",
        "attention.v_proj": "attn.Wv",
        "attention.out_proj": "attn.Wo",
        "attn_norm": "attn_norm",
        "feed_forward.gate_proj": "mlp.Wi_in",
        "feed_forward.up_proj": "mlp.Wi_gate",
        "feed_forward.down_proj": "mlp.Wo",
        "ffn_norm": "mlp_norm",
    }
    own = model.state_dict()
    m = {k: v for k, v in m.items() if k in own}
    return m | per_layer_keys(len(model.layers), parts, "layers", present=own)


def to_hf_model(model: nn.Module) -> nn.Module:
    assert isinstance(model, EncoderModel)
    c = model.config
    if c.position_embedding_type != "rope" or c.mlp != "gated" or c.norm_position != "pre":
        raise ValueError(
            "ModernBERT is a pre-LN RoPE encoder with GeGLU; this EncoderModel has "
            f"position_embedding_type={c.position_embedding_type!r}, mlp={c.mlp!r}, "
            f"norm_position={c.norm_position!r}"
        )
    if c.type_vocab_size or c.add_pooler or c.first_attn_norm or c.attention_window:
        raise ValueError(
            "ModernBERT has no token types, no pooler, no first attention norm and no "
            "Longformer attention"
        )
    if c.attention_bias != c.mlp_bias or c.num_key_value_heads != c.num_attention_heads:
        raise ValueError("ModernBERT has one bias setting (attention and MLP) and no GQA")
    windows = set(c.local_attention or ()) - {None}
    if len(windows) > 1:
        raise ValueError(f"ModernBERT has one local window, got {windows}")
    local = windows.pop() if windows else 128
    types = [SLIDING if w else FULL for w in (c.local_attention or (None,) * c.num_hidden_layers)]
    tf = require_transformers()
    cfg = tf.ModernBertConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        hidden_activation=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings,
        norm_eps=c.layer_norm_eps,
        norm_bias=c.norm_bias,
        pad_token_id=c.pad_token_id,
        attention_bias=c.attention_bias,
        mlp_bias=c.mlp_bias,
        attention_dropout=c.attention_probs_dropout_prob,
        mlp_dropout=c.hidden_dropout_prob,
        layer_types=types,
        local_attention=local,
        rope_parameters={
            FULL: {"rope_type": "default", "rope_theta": c.rope_theta},
            SLIDING: {
                "rope_type": "default",
                "rope_theta": c.local_rope_theta or c.rope_theta,
            },
        },
    )
    return tf.ModernBertModel(cfg)


MODERNBERT = register_converter(
    Converter(
        model_type="modernbert",
        hf_classes={"ModernBertModel": ""},
        base_prefix="model.",
        attnlab_class=EncoderModel,
        config_from_hf=config_from_hf,
        build=EncoderModel,
        key_map=key_map,
        to_hf_model=to_hf_model,
        weights_from_hf=split_fused,
        weights_to_hf=fuse,
        folder_extras=attach_sentence_settings,
        accepts=lambda m: isinstance(m, EncoderModel) and m.config.model_type == "modernbert",
    )
)
