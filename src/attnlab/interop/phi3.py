"""Phi-3 (``model_type == "phi3"``) and SmolLM3 (``"smollm3"``) <-> :class:`DecoderLM`.

* Phi-3 (Abdin et al., 2024): Llama's computation with fused projections, a load and save
  layout only: ``self_attn.qkv_proj`` (query, key, value rows stacked) and
  ``mlp.gate_up_proj`` (gate rows, then up rows) are split into attnlab's separate
  projections on the way in and concatenated on the way out. LongRoPE
  (``rope_type="longrope"``: short factors within ``original_max_position_embeddings``,
  long ones beyond) and partial rotary (``partial_rotary_factor``, Phi-3.5 / Phi-4-mini)
  are RoPE settings of the one :class:`~attnlab.modules.positions.RotaryEmbedding`.
* SmolLM3 (Hugging Face, 2025): Llama's components with RoPE left out of the layers
  ``no_rope_layers`` marks 0 (every fourth by default: NoPE layers,
  ``LayerSpec(rope=False)``), GQA, and windowed layers when ``use_sliding_window``.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.interop.hf import Converter, register_converter, require_transformers
from attnlab.interop.llama import (
    _hf_kwargs,
    add_tied_head,
    claims,
    decoder_fields,
    drop_tied_head,
    key_map,
    rope_to_hf,
)
from attnlab.interop.qwen import FULL, SLIDING, layer_types_to_hf
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.layout import LayerSpec

__all__ = ["PHI3", "SMOLLM3", "fuse_projections", "split_projections"]

_QKV = re.compile(r"^(?P<layer>model\.layers\.\d+)\.self_attn\.qkv_proj\.weight$")
_GATE_UP = re.compile(r"^(?P<layer>model\.layers\.\d+)\.mlp\.gate_up_proj\.weight$")


def split_projections(weights: dict[str, Tensor], config: DecoderConfig) -> dict[str, Tensor]:
    """Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` as separate q/k/v and gate/up
    weights under Llama's names; then drop a tied head's copy."""
    assert config.head_dim is not None and config.num_key_value_heads is not None
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    out: dict[str, Tensor] = {}
    for key, t in weights.items():
        if m := _QKV.match(key):
            if t.shape[0] != q + 2 * kv:
                raise ValueError(
                    f"{key} has {t.shape[0]} rows; q {q} + k {kv} + v {kv} = {q + 2 * kv}"
                )
            for name, part in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                out[f"{m['layer']}.self_attn.{name}.weight"] = part
        elif m := _GATE_UP.match(key):
            gate, up = t.chunk(2, dim=0)
            out[f"{m['layer']}.mlp.gate_proj.weight"] = gate
            out[f"{m['layer']}.mlp.up_proj.weight"] = up
        else:
            out[key] = t
    return drop_tied_head(out, config)


def fuse_projections(weights: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """The inverse of :func:`split_projections` (and the tied head's copy added back)."""
    out = dict(add_tied_head(weights, model))
    for key in [k for k in out if k.endswith(".self_attn.q_proj.weight")]:
        layer = key[: -len(".self_attn.q_proj.weight")]
        parts = [out.pop(f"{layer}.self_attn.{n}.weight") for n in ("q_proj", "k_proj", "v_proj")]
        out[f"{layer}.self_attn.qkv_proj.weight"] = torch.cat(parts)
    for key in [k for k in out if k.endswith(".mlp.gate_proj.weight")]:
        layer = key[: -len(".mlp.gate_proj.weight")]
        gate, up = out.pop(f"{layer}.mlp.gate_proj.weight"), out.pop(f"{layer}.mlp.up_proj.weight")
        out[f"{layer}.mlp.gate_up_proj.weight"] = torch.cat((gate, up))
    return out


def _partial(cfg: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """``cfg`` without its partial rotary factor (top-level or in ``rope_parameters``)."""
    cfg = dict(cfg)
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    factor = params.pop("partial_rotary_factor", None)
    factor = cfg.pop("partial_rotary_factor", 1.0) if factor is None else factor
    if params.get("rope_type", params.get("type")) in ("longrope", "su"):
        params["rope_type"] = "longrope"
        params.setdefault(
            "original_max_position_embeddings", cfg["original_max_position_embeddings"]
        )
        params.pop("type", None)
    cfg["rope_parameters"], cfg["rope_scaling"] = params, None
    return cfg, float(factor)


def phi3_config(cfg: dict[str, Any], weight_names: set[str]) -> DecoderConfig:
    cfg, partial = _partial(cfg)
    resid, embd = cfg.get("resid_pdrop", 0.0) or 0.0, cfg.get("embd_pdrop", 0.0) or 0.0
    if resid != embd and embd:
        raise ValueError(
            f"Phi-3 with embd_pdrop={embd} != resid_pdrop={resid} is not supported (attnlab "
            "has one hidden_dropout)"
        )
    return DecoderConfig(
        **decoder_fields(cfg),
        attention_bias=bool(cfg.get("attention_bias", False)),
        sliding_window=cfg.get("sliding_window"),
        partial_rotary_factor=partial,
        hidden_dropout=float(resid),
        model_type="phi3",
    )


def _check(c: DecoderConfig, arch: str) -> None:
    if c.position_embedding != "rope" or c.norm != "rmsnorm" or c.mlp != "gated" or c.qk_norm:
        raise ValueError(f"{arch} is RoPE + RMSNorm + gated MLP, without QK-norm")
    if c.moe_layers or c.norm_placement != "pre" or c.rope_convention != "half":
        raise ValueError(f"{arch} has dense pre-norm layers and rotate-half RoPE")
    out_bias = c.attention_bias if c.attention_out_bias is None else c.attention_out_bias
    if out_bias != c.attention_bias:
        raise ValueError(f"{arch} has one bias setting for q/k/v/o")


def phi3_to_hf(model: nn.Module) -> nn.Module:
    assert isinstance(model, DecoderLM)
    c = model.config
    _check(c, "Phi-3")
    if c.attention_bias or c.mlp_bias or any(s != LayerSpec() for s in c.layer_specs):
        raise ValueError("Phi-3 has no biases and the same attention in every layer")
    tf = require_transformers()
    kw = _hf_kwargs(c)
    rope = rope_to_hf(c) | {"partial_rotary_factor": c.partial_rotary_factor}
    original = rope.get("original_max_position_embeddings", c.max_position_embeddings)
    kw |= dict(rope_parameters=rope, original_max_position_embeddings=original)
    cfg = tf.Phi3Config(
        **kw,
        sliding_window=c.sliding_window,
        resid_pdrop=c.hidden_dropout,
        embd_pdrop=c.hidden_dropout,
    )
    return tf.Phi3ForCausalLM(cfg)


def smollm3_config(cfg: dict[str, Any], weight_names: set[str]) -> DecoderConfig:
    n = cfg["num_hidden_layers"]
    interval = cfg.get("no_rope_layer_interval", 4)
    rope = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    types = cfg.get("layer_types") or [FULL] * n
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    if len(rope) != n or len(types) != n:
        raise ValueError(
            f"no_rope_layers and layer_types must list {n} layers, got {rope!r}, {types!r}"
        )
    layers = tuple(
        LayerSpec(rope=bool(r), sliding_window=window if t == SLIDING else None)
        for r, t in zip(rope, types)
    )
    return DecoderConfig(
        **decoder_fields(cfg),
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        layers=layers if any(s != LayerSpec() for s in layers) else None,
        model_type="smollm3",
    )


def smollm3_to_hf(model: nn.Module) -> nn.Module:
    assert isinstance(model, DecoderLM)
    c = model.config
    _check(c, "SmolLM3")
    if any(s.mixer != "attention" or s.rope_theta is not None for s in c.layer_specs):
        raise ValueError("SmolLM3 has attention with one RoPE base (or none) in every layer")
    tf = require_transformers()
    cfg = tf.SmolLM3Config(
        **_hf_kwargs(c),
        attention_bias=c.attention_bias,
        mlp_bias=c.mlp_bias,
        no_rope_layers=[int(s.rope) for s in c.layer_specs],
        **layer_types_to_hf(c),
    )
    return tf.SmolLM3ForCausalLM(cfg)


def _no_rope_layers(c: DecoderConfig) -> bool:
    return any(not s.rope for s in c.layer_specs) and not c.qk_norm


PHI3 = register_converter(
    Converter(
        model_type="phi3",
        hf_classes={"Phi3ForCausalLM": ""},
        attnlab_class=DecoderLM,
        config_from_hf=phi3_config,
        build=DecoderLM,
        key_map=key_map,
        to_hf_model=phi3_to_hf,
        weights_from_hf=split_projections,
        weights_to_hf=fuse_projections,
        accepts=lambda m: claims(m, "phi3", lambda c: False),  # Llama's computation: by name
    )
)

SMOLLM3 = register_converter(
    Converter(
        model_type="smollm3",
        hf_classes={"SmolLM3ForCausalLM": ""},
        attnlab_class=DecoderLM,
        config_from_hf=smollm3_config,
        build=DecoderLM,
        key_map=key_map,
        to_hf_model=smollm3_to_hf,
        weights_from_hf=drop_tied_head,
        weights_to_hf=add_tied_head,
        accepts=lambda m: claims(m, "smollm3", _no_rope_layers),
    )
)
