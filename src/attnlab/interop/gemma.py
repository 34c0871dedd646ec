"""Gemma 2 (``model_type == "gemma2"``) and Gemma 3's text decoder (``"gemma3_text"``) <-> :class:`DecoderLM`.

Every Gemma detail is a component or a value of the one decoder:

* local and global layers: ``LayerSpec(sliding_window=W)`` on transformers'
  ``"sliding_attention"`` layers (a ``sliding_window`` pattern; block-skipping backends
  skip the tiles outside it), the ``"full_attention"`` layers causal;
* soft-capping (Gemma 2): ``softcap(c)`` as a score modifier on the attention pattern,
  and ``c * tanh(logits / c)`` on the output logits;
* ``query_pre_attn_scalar``: the scores' scale, ``MultiHeadAttention(scale=...)``;
* the sandwich of four norms per layer, each ``x * (1 + w)``
  (:class:`~attnlab.modules.norms.OffsetRMSNorm`);
* Gemma 3: per-head QK-norm, and a RoPE base of its own on the local layers
  (``LayerSpec(rope_theta=...)``: one rotary module per base);
* token embeddings scaled by ``sqrt(hidden_size)`` in the weights' dtype.

Key names: transformers' ``post_attention_layernorm`` is Gemma's norm on the attention
output (Llama's is the feed-forward's input norm), ``pre_feedforward_layernorm`` and
``post_feedforward_layernorm`` surround the MLP.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from attnlab.interop.hf import (
    Converter,
    per_layer_keys,
    register_converter,
    require_transformers,
)
from attnlab.interop.llama import _first, add_tied_head, claims, drop_tied_head, rope_from_hf
from attnlab.interop.qwen import FULL, SLIDING
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.layout import LayerSpec

__all__ = ["GEMMA2", "GEMMA3"]


def _layers(cfg: dict[str, Any], local_theta: float | None) -> tuple[LayerSpec, ...]:
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        period = cfg.get("sliding_window_pattern") or (2 if cfg["model_type"] == "gemma2" else 6)
        types = [SLIDING if (i + 1) % period else FULL for i in range(n)]
    if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
        raise ValueError(f"layer_types must list {n} of {[SLIDING, FULL]}, got {types!r}")
    window = cfg.get("sliding_window")
    local = LayerSpec(sliding_window=window, rope_theta=local_theta)
    return tuple(local if t == SLIDING and window else LayerSpec() for t in types)


def _common(cfg: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("Gemma with use_bidirectional_attention=True is not supported")
    theta, scaling = rope_from_hf({"rope_parameters": rope})
    heads = cfg["num_attention_heads"]
    return dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg["intermediate_size"],
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        norm="gemma_rmsnorm",
        norm_placement="sandwich",
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=cfg.get("max_position_embeddings", 8192),
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=bool(cfg.get("attention_bias", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        attention_dropout=float(cfg.get("attention_dropout", 0.0) or 0.0),
        query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]),
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        embedding_scale=cfg["hidden_size"] ** 0.5,
        pad_token_id=cfg.get("pad_token_id"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=_first(cfg.get("eos_token_id")),
    )


def gemma2_config(cfg: dict[str, Any], weight_names: set[str]) -> DecoderConfig:
    rope = dict(cfg.get("rope_parameters") or {"rope_theta": cfg.get("rope_theta", 10000.0)})
    return DecoderConfig(**_common(cfg, rope), layers=_layers(cfg, None), model_type="gemma2")


def gemma3_config(cfg: dict[str, Any], weight_names: set[str]) -> DecoderConfig:
    rope = cfg.get("rope_parameters") or {}
    full = dict(rope.get("full_attention") or {"rope_theta": cfg.get("rope_theta", 1e6)})
    local = dict(rope.get("sliding_attention") or {})
    if local.get("rope_type", "default") != "default":
        raise ValueError(
            f"Gemma 3 with a scaled RoPE on its local layers ({local}) is not supported"
        )
    local_theta = float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
    return DecoderConfig(
        **_common(cfg, full),
        qk_norm=True,
        qk_norm_scope="head",
        layers=_layers(cfg, local_theta),
        model_type="gemma3_text",
    )


def key_map(model: nn.Module) -> dict[str, str]:
    assert isinstance(model, DecoderLM)
    m = {"embed_tokens.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if model.lm_head is not None:
        m["lm_head.weight"] = "lm_head.weight"
    parts = {
        "self_attention.q_proj": "self_attn.q_proj",
        "self_attention.k_proj": "self_attn.k_proj",
        "self_attention.v_proj": "self_attn.v_proj",
        "self_attention.out_proj": "self_attn.o_proj",
        "self_attention.q_norm.norm": "self_attn.q_norm",
        "self_attention.k_norm.norm": "self_attn.k_norm",
        "feed_forward.gate_proj": "mlp.gate_proj",
        "feed_forward.up_proj": "mlp.up_proj",
        "feed_forward.down_proj": "mlp.down_proj",
        "self_attn_norm": "input_layernorm",
        "post_attn_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffn_norm": "post_feedforward_layernorm",
    }
    return m | per_layer_keys(len(model.layers), parts, "model.layers", present=model.state_dict())


def _hf_kwargs(c: DecoderConfig, arch: str) -> dict[str, Any]:
    if c.norm != "gemma_rmsnorm" or c.norm_placement != "sandwich" or c.mlp != "gated":
        raise ValueError(
            f"{arch} has sandwich norms of x * (1 + w) and a gated MLP; this DecoderLM has "
            f"norm={c.norm!r}, norm_placement={c.norm_placement!r}, mlp={c.mlp!r}"
        )
    if c.embedding_scale != c.hidden_size**0.5 or c.query_pre_attn_scalar is None:
        raise ValueError(
            f"{arch} scales its embeddings by sqrt(hidden_size) and needs "
            f"query_pre_attn_scalar; got embedding_scale={c.embedding_scale}, "
            f"query_pre_attn_scalar={c.query_pre_attn_scalar}"
        )
    if (
        c.moe_layers
        or c.mlp_bias
        or any(s.mixer != "attention" or not s.rope for s in c.layer_specs)
    ):
        raise ValueError(f"{arch} has attention with RoPE and a dense MLP in every layer")
    windows = {c.layer_window(i) for i in range(c.num_hidden_layers)} - {None}
    if len(windows) > 1:
        raise ValueError(f"{arch} has one sliding window for its local layers, got {windows}")
    window = windows.pop() if windows else None
    types = [SLIDING if c.layer_window(i) else FULL for i in range(c.num_hidden_layers)]
    return dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        intermediate_size=c.intermediate_size,
        hidden_activation=c.hidden_act,
        rms_norm_eps=c.norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        attention_bias=c.attention_bias,
        attention_dropout=c.attention_dropout,
        query_pre_attn_scalar=_int_if_whole(c.query_pre_attn_scalar),
        sliding_window=window,
        layer_types=types,
        final_logit_softcapping=c.final_logit_softcapping,
        attn_logit_softcapping=c.attn_logit_softcapping,
        tie_word_embeddings=c.tie_word_embeddings,
        pad_token_id=c.pad_token_id,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
    )


def _int_if_whole(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x  # transformers' field is an int


def _rope(theta: float, scaling: dict[str, Any] | None) -> dict[str, Any]:
    return {"rope_type": "default"} | dict(scaling or {}) | {"rope_theta": theta}


def gemma2_to_hf(model: nn.Module) -> nn.Module:
    assert isinstance(model, DecoderLM)
    c = model.config
    kw = _hf_kwargs(c, "Gemma 2")
    if c.qk_norm or any(s.rope_theta is not None for s in c.layer_specs):
        raise ValueError("Gemma 2 has no QK-norm and one RoPE base")
    tf = require_transformers()
    cfg = tf.Gemma2Config(**kw, rope_parameters=_rope(c.rope_theta, c.rope_scaling))
    cfg._attn_implementation = "eager"  # sdpa cannot soft-cap
    return tf.Gemma2ForCausalLM(cfg)


def gemma3_to_hf(model: nn.Module) -> nn.Module:
    assert isinstance(model, DecoderLM)
    c = model.config
    kw = _hf_kwargs(c, "Gemma 3")
    if not (c.qk_norm and c.qk_norm_scope == "head"):
        raise ValueError("Gemma 3 has per-head QK-norm")
    local = {s.rope_theta for s, w in zip(c.layer_specs, kw["layer_types"]) if w == SLIDING}
    thetas = [t for t in local if t is not None]
    if len(local) > 1 or len(thetas) != len(local):
        raise ValueError(f"Gemma 3's local layers share one RoPE base of their own, got {local}")
    rope = {
        "full_attention": _rope(c.rope_theta, c.rope_scaling),
        "sliding_attention": _rope(thetas[0] if thetas else 10000.0, None),
    }
    tf = require_transformers()
    cfg = tf.Gemma3TextConfig(**kw, rope_parameters=rope)
    return tf.Gemma3ForCausalLM(cfg)


def _is(model_type: str) -> Any:
    def infer(c: DecoderConfig) -> bool:
        if c.norm != "gemma_rmsnorm" or c.norm_placement != "sandwich":
            return False
        return c.qk_norm == (model_type == "gemma3_text")

    return infer


def _converter(model_type: str, hf_class: str, config: Any, to_hf: Any) -> Converter:
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
            accepts=lambda m: claims(m, model_type, _is(model_type)),
        )
    )


GEMMA2 = _converter("gemma2", "Gemma2ForCausalLM", gemma2_config, gemma2_to_hf)
GEMMA3 = _converter("gemma3_text", "Gemma3ForCausalLM", gemma3_config, gemma3_to_hf)
