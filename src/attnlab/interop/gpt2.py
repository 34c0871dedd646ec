"""GPT-2 (``model_type == "gpt2"``) <-> :class:`DecoderLM`.

GPT-2 stores its projections as ``Conv1D`` (weight ``[in, out]``, the transpose of
``nn.Linear``) and fuses q, k and v into ``c_attn``; the conversion splits and
transposes them.
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

_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def config_from_hf(cfg: dict[str, Any], weight_names: set[str]) -> DecoderConfig:
    for flag in (
        "scale_attn_by_inverse_layer_idx",
        "reorder_and_upcast_attn",
        "add_cross_attention",
    ):
        if cfg.get(flag):
            raise ValueError(f"GPT-2 with {flag}=True is not supported")
    if cfg.get("scale_attn_weights", True) is False:
        raise ValueError("GPT-2 with scale_attn_weights=False is not supported")
    d = cfg["n_embd"]
    return DecoderConfig.gpt2(
        vocab_size=cfg["vocab_size"],
        hidden_size=d,
        num_hidden_layers=cfg["n_layer"],
        num_attention_heads=cfg["n_head"],
        intermediate_size=cfg.get("n_inner") or 4 * d,
        hidden_act=cfg.get("activation_function", "gelu_new"),
        norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
        max_position_embeddings=cfg["n_positions"],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        attention_dropout=cfg.get("attn_pdrop", 0.0),
        hidden_dropout=cfg.get("resid_pdrop", 0.0),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"),
        pad_token_id=cfg.get("pad_token_id"),
    )


def key_map(model: nn.Module) -> dict[str, str]:
    assert isinstance(model, DecoderLM)
    m = {
        "embed_tokens.weight": "transformer.wte.weight",
        "embed_positions.weight": "transformer.wpe.weight",
        "norm.weight": "transformer.ln_f.weight",
        "norm.bias": "transformer.ln_f.bias",
    }
    if model.lm_head is not None:
        m["lm_head.weight"] = "lm_head.weight"
    parts = {
        "self_attention.q_proj": "attn.c_attn.q",
        "self_attention.k_proj": "attn.c_attn.k",
        "self_attention.v_proj": "attn.c_attn.v",
        "self_attention.out_proj": "attn.c_proj",
        "feed_forward.fc_in": "mlp.c_fc",
        "feed_forward.fc_out": "mlp.c_proj",
        "self_attn_norm": "ln_1",
        "ffn_norm": "ln_2",
    }
    return m | per_layer_keys(len(model.layers), parts, "transformer.h")


def weights_from_hf(weights: dict[str, Tensor], config: DecoderConfig) -> dict[str, Tensor]:
    """Transpose Conv1D weights, split ``c_attn`` into q/k/v, drop a tied head and masks."""
    out: dict[str, Tensor] = {}
    for k, v in weights.items():
        if k.endswith((".attn.bias", ".attn.masked_bias")) or (
            k == "lm_head.weight" and config.tie_word_embeddings
        ):
            continue  # causal-mask buffers of old checkpoints; a tied copy
        name = k.rsplit(".", 1)[0]
        if name.endswith(_CONV1D) and k.endswith(".weight"):
            v = v.t()
        if name.endswith("attn.c_attn"):
            kind = k.rsplit(".", 1)[1]
            for part, t in zip("qkv", v.chunk(3, dim=0)):
                out[f"{name}.{part}.{kind}"] = t.contiguous()
            continue
        out[k] = v.contiguous() if name.endswith(_CONV1D) else v
    return out


def weights_to_hf(weights: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """The inverse of :func:`weights_from_hf`."""
    assert isinstance(model, DecoderLM)
    out: dict[str, Tensor] = {}
    for k, v in weights.items():
        name, kind = k.rsplit(".", 1)
        if name.endswith(("attn.c_attn.q", "attn.c_attn.k", "attn.c_attn.v")):
            if name.endswith(".q"):
                base = name[:-2]
                fused = torch.cat([weights[f"{base}.{p}.{kind}"] for p in "qkv"], dim=0)
                out[f"{base}.{kind}"] = fused.t().contiguous() if kind == "weight" else fused
            continue
        if name.endswith(_CONV1D) and kind == "weight":
            v = v.t().contiguous()
        out[k] = v
    if model.lm_head is None:
        out["lm_head.weight"] = model.embed_tokens.weight.detach()
    return out


def to_hf_model(model: nn.Module) -> nn.Module:
    assert isinstance(model, DecoderLM)
    c = model.config
    if (
        c.num_key_value_heads != c.num_attention_heads
        or c.norm != "layernorm"
        or c.mlp != "standard"
    ):
        raise ValueError(
            "GPT-2 is multi-head attention with LayerNorm and a plain MLP; got "
            f"num_key_value_heads={c.num_key_value_heads}, norm={c.norm!r}, mlp={c.mlp!r}"
        )
    if c.head_dim * c.num_attention_heads != c.hidden_size:  # type: ignore[operator]
        raise ValueError("GPT-2 needs head_dim * num_attention_heads == hidden_size")
    tf = require_transformers()
    cfg = tf.GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=c.max_position_embeddings,
        n_embd=c.hidden_size,
        n_layer=c.num_hidden_layers,
        n_head=c.num_attention_heads,
        n_inner=c.intermediate_size,
        activation_function=c.hidden_act,
        layer_norm_epsilon=c.norm_eps,
        resid_pdrop=c.hidden_dropout,
        embd_pdrop=c.hidden_dropout,
        attn_pdrop=c.attention_dropout,
        tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        pad_token_id=c.pad_token_id,
    )
    return tf.GPT2LMHeadModel(cfg)


GPT2 = register_converter(
    Converter(
        model_type="gpt2",
        hf_classes={"GPT2LMHeadModel": ""},
        attnlab_class=DecoderLM,
        config_from_hf=config_from_hf,
        build=DecoderLM,
        key_map=key_map,
        to_hf_model=to_hf_model,
        weights_from_hf=weights_from_hf,
        weights_to_hf=weights_to_hf,
        accepts=lambda m: isinstance(m, DecoderLM) and m.config.position_embedding == "learned",
    )
)
