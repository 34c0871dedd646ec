"""Qwen2 / Qwen2.5 (``model_type == "qwen2"``) and Qwen3 (``"qwen3"``) <-> :class:`DecoderLM`.

Both are Llama-shaped decoders (RoPE, RMSNorm, SwiGLU, GQA):

* Qwen2 and Qwen2.5 (Qwen team, 2024): biases on the query, key and value projections
  (none on the output projection);
* Qwen3 (Qwen team, 2025): RMSNorm on each head's queries and keys before RoPE
  (``qk_norm_scope="head"``), biases only when ``attention_bias``.

Either may window some layers: with ``use_sliding_window``, the layers transformers'
``layer_types`` marks ``"sliding_attention"`` (by default those from
``max_window_layers`` on) see the last ``sliding_window`` tokens; in attnlab that is a
per-layer ``LayerSpec(sliding_window=W)``, a ``sliding_window`` pattern on those layers.
The dense MoE sibling, Qwen3-MoE, lives in :mod:`attnlab.interop.moe`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from attnlab.interop.hf import Converter, register_converter, require_transformers
from attnlab.interop.llama import (
    _hf_kwargs,
    add_tied_head,
    claims,
    decoder_fields,
    drop_tied_head,
)
from attnlab.interop.llama import key_map as llama_key_map
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.layout import LayerSpec

__all__ = ["QWEN2", "QWEN3", "layer_types_to_hf", "windowed_layers"]

SLIDING, FULL = "sliding_attention", "full_attention"


def windowed_layers(cfg: dict[str, Any], window: int | None) -> tuple[LayerSpec, ...] | None:
    """Per-layer specs from transformers' ``layer_types`` (``window`` on the sliding ones),
    or None when no layer is windowed.

    Raises:
        ValueError: an unknown layer type, or a list of the wrong length.
    """
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:  # an older config.json: windows from max_window_layers on
        first = cfg.get("max_window_layers", n)
        types = [SLIDING if window is not None and i >= first else FULL for i in range(n)]
    if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
        raise ValueError(f"layer_types must list {n} of {[SLIDING, FULL]}, got {types!r}")
    if window is None or SLIDING not in types:
        return None
    return tuple(LayerSpec(sliding_window=window if t == SLIDING else None) for t in types)


def layer_types_to_hf(c: DecoderConfig) -> dict[str, Any]:
    """``use_sliding_window``, ``sliding_window`` and ``layer_types`` of a Qwen config.

    Raises:
        ValueError: layers with different windows (transformers has one).
    """
    windows = {c.layer_window(i) for i in range(c.num_hidden_layers)} - {None}
    if len(windows) > 1:
        raise ValueError(f"Qwen has one sliding window for all windowed layers, got {windows}")
    window = windows.pop() if windows else None
    types = [SLIDING if c.layer_window(i) else FULL for i in range(c.num_hidden_layers)]
    return dict(use_sliding_window=window is not None, sliding_window=window, layer_types=types)


def _window(cfg: dict[str, Any]) -> int | None:
    return cfg.get("sliding_window") if cfg.get("use_sliding_window") else None


def qwen2_config(cfg: dict[str, Any], weight_names: set[str]) -> DecoderConfig:
    return DecoderConfig(
        **decoder_fields(cfg),
        attention_bias=True,
        attention_out_bias=False,
        layers=windowed_layers(cfg, _window(cfg)),
        model_type="qwen2",
    )


def qwen3_config(cfg: dict[str, Any], weight_names: set[str]) -> DecoderConfig:
    return DecoderConfig(
        **decoder_fields(cfg),
        attention_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=True,
        qk_norm_scope="head",
        layers=windowed_layers(cfg, _window(cfg)),
        model_type="qwen3",
    )


def key_map(model: nn.Module) -> dict[str, str]:
    """Llama's names, plus Qwen3's per-head ``self_attn.q_norm``/``k_norm``."""
    assert isinstance(model, DecoderLM)
    m = llama_key_map(model)
    for i in range(len(model.layers)):
        for ours, theirs in (("q_norm", "q_norm"), ("k_norm", "k_norm")):
            key = f"layers.{i}.self_attention.{ours}.norm.weight"
            if key in model.state_dict():
                m[key] = f"model.layers.{i}.self_attn.{theirs}.weight"
    return m


def _check_dense(c: DecoderConfig, arch: str) -> None:
    if c.position_embedding != "rope" or c.norm != "rmsnorm" or c.mlp != "gated":
        raise ValueError(
            f"{arch} is RoPE + RMSNorm + gated MLP; this DecoderLM has position_embedding="
            f"{c.position_embedding!r}, norm={c.norm!r}, mlp={c.mlp!r}"
        )
    if c.moe_layers or any(s.mixer != "attention" or not s.rope for s in c.layer_specs):
        raise ValueError(f"{arch} has attention, RoPE and a dense feed-forward in every layer")
    if c.mlp_bias or c.norm_placement != "pre" or c.rope_convention != "half":
        raise ValueError(f"{arch} has no MLP biases, pre-norm layers and rotate-half RoPE")


def qwen2_to_hf(model: nn.Module) -> nn.Module:
    assert isinstance(model, DecoderLM)
    c = model.config
    _check_dense(c, "Qwen2")
    if not c.attention_bias or c.attention_out_bias is not False or c.qk_norm:
        raise ValueError(
            "Qwen2 has biases on q/k/v and none on the output projection, and no QK-norm "
            f"(attention_bias={c.attention_bias}, attention_out_bias={c.attention_out_bias})"
        )
    tf = require_transformers()
    return tf.Qwen2ForCausalLM(tf.Qwen2Config(**_hf_kwargs(c), **layer_types_to_hf(c)))


def qwen3_to_hf(model: nn.Module) -> nn.Module:
    assert isinstance(model, DecoderLM)
    c = model.config
    _check_dense(c, "Qwen3")
    out_bias = c.attention_bias if c.attention_out_bias is None else c.attention_out_bias
    if not (c.qk_norm and c.qk_norm_scope == "head") or out_bias != c.attention_bias:
        raise ValueError("Qwen3 has per-head QK-norm and one bias setting for q/k/v/o")
    tf = require_transformers()
    cfg = tf.Qwen3Config(**_hf_kwargs(c), attention_bias=c.attention_bias, **layer_types_to_hf(c))
    return tf.Qwen3ForCausalLM(cfg)


def _is_qwen2(c: DecoderConfig) -> bool:
    return bool(
        c.attention_bias and c.attention_out_bias is False and not c.qk_norm and not c.moe_layers
    )


def _is_qwen3(c: DecoderConfig) -> bool:
    return c.qk_norm and c.qk_norm_scope == "head" and c.norm == "rmsnorm" and not c.moe_layers


def _converter(model_type: str, hf_class: str, config: Any, to_hf: Any, infer: Any) -> Converter:
    return register_converter(
        Converter(
            model_type=model_type,
            hf_classes={hf_class: ""},
            attnlab_class=DecoderLM,
            config_from_hf=config,
            build=DecoderLM,
            key_map=key_map,
            to_hf_model=to_hf,
            weights_from_hf=drop_tied_head,
            weights_to_hf=add_tied_head,
            accepts=lambda m: claims(m, model_type, infer),
        )
    )


QWEN2 = _converter("qwen2", "Qwen2ForCausalLM", qwen2_config, qwen2_to_hf, _is_qwen2)
QWEN3 = _converter("qwen3", "Qwen3ForCausalLM", qwen3_config, qwen3_to_hf, _is_qwen3)
