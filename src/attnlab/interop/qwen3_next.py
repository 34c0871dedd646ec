"""Qwen3-Next (``model_type == "qwen3_next"``) <-> :class:`DecoderLM` with a hybrid layout.

Qwen Team (2025), Qwen3-Next: Gated DeltaNet layers (``layer_types`` ``"linear_attention"``)
and gated softmax attention (``"full_attention"``), each followed by a mixture of experts
with a gated shared expert (dense MLPs in ``mlp_only_layers``). In attnlab that is a
``DecoderConfig.layers`` layout of ``LayerSpec(mixer="gated_delta_net" | "gated_attention")``
(:mod:`attnlab.models.linear_mixers`); one :class:`~attnlab.cache.base.ModelCache` holds a
KV cache per attention layer and a :class:`~attnlab.cache.linear_state.DeltaNetState` per
Gated DeltaNet layer.

What maps to what:

* zero-centred norms ``x (1 + w)`` everywhere but inside Gated DeltaNet
  (``norm="gemma_rmsnorm"``), per-head QK-norm, RoPE on ``partial_rotary_factor`` of each head;
* transformers' ``q_proj`` holds, per head, the query rows then the output gate's rows:
  they are split into ``attention.q_proj`` and ``gate_proj`` (and joined back by ``to_hf``);
* the router is a softmax then top-k (renormalised when ``norm_topk_prob``), experts
  batched as in transformers 5, the shared expert gated by ``sigmoid(w . x)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnlab.interop.hf import require_transformers
from attnlab.interop.hybrid import (
    hybrid_converter,
    layer_key_map,
    linear_settings,
    special_tokens,
    special_tokens_to_hf,
)
from attnlab.interop.llama import add_tied_head, rope_from_hf
from attnlab.interop.moe import fuse_experts
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.layout import LayerSpec, MoEConfig
from attnlab.models.linear_layout import LinearLayerConfig

__all__ = ["QWEN3_NEXT"]

LINEAR, FULL = "linear_attention", "full_attention"

# attnlab sub-module path -> transformers sub-module path, within one layer
_PARTS = {
    "self_attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "self_attention.attention.q_proj": "self_attn.q_proj_query",  # split by weights_from_hf
    "self_attention.gate_proj": "self_attn.q_proj_gate",
    "self_attention.attention.k_proj": "self_attn.k_proj",
    "self_attention.attention.v_proj": "self_attn.v_proj",
    "self_attention.attention.q_norm.norm": "self_attn.q_norm",
    "self_attention.attention.k_norm.norm": "self_attn.k_norm",
    "self_attention.out_proj": "self_attn.o_proj",
    "self_attention.mixer": "linear_attn",  # Gated DeltaNet keeps transformers' names
    "feed_forward.gate_proj": "mlp.gate_proj",
    "feed_forward.up_proj": "mlp.up_proj",
    "feed_forward.down_proj": "mlp.down_proj",
    "feed_forward.router": "mlp.gate",
    "feed_forward.shared_expert.gate_proj": "mlp.shared_expert.gate_proj",
    "feed_forward.shared_expert.up_proj": "mlp.shared_expert.up_proj",
    "feed_forward.shared_expert.down_proj": "mlp.shared_expert.down_proj",
    "feed_forward.shared_expert_gate": "mlp.shared_expert_gate",
    "feed_forward.experts.w_in": "mlp.experts.gate_up_proj",
    "feed_forward.experts.w_out": "mlp.experts.down_proj",
}


def _layer_types(cfg: dict[str, Any]) -> list[str]:
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:  # transformers' default: every fourth layer full attention
        interval = cfg.get("full_attention_interval", 4)
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
    if len(types) != n or any(t not in (LINEAR, FULL) for t in types):
        raise ValueError(f"layer_types must list {n} of {[LINEAR, FULL]}, got {types!r}")
    return list(types)


def qwen3_next_config(cfg: dict[str, Any], weight_names: set[str]) -> DecoderConfig:
    """The attnlab config of a transformers ``Qwen3NextConfig`` (as a dict)."""
    n, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    gdn = LinearLayerConfig(
        num_heads=cfg.get("linear_num_key_heads", 16),
        num_value_heads=cfg.get("linear_num_value_heads", 32),
        head_dim=cfg.get("linear_key_head_dim", 128),
        value_head_dim=cfg.get("linear_value_head_dim", 128),
        conv_kernel=cfg.get("linear_conv_kernel_dim", 4),
    )
    experts = cfg.get("num_experts", 512)
    shared = cfg.get("shared_expert_intermediate_size", 0)
    moe = (
        MoEConfig(
            num_experts=experts,
            top_k=cfg.get("num_experts_per_tok", 10),
            intermediate_size=cfg.get("moe_intermediate_size", 512),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            hidden_act=cfg.get("hidden_act", "silu"),
            shared_expert_intermediate_size=shared,
            shared_expert_gate=bool(shared),
            router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
        )
        if experts > 0
        else None
    )
    dense_only = set(cfg.get("mlp_only_layers") or [])
    step = cfg.get("decoder_sparse_step", 1) or 1
    layers = []
    for i, t in enumerate(_layer_types(cfg)):
        sparse = moe is not None and i not in dense_only and (i + 1) % step == 0
        mixer = (
            dict(mixer="gated_attention")
            if t == FULL
            else dict(mixer="gated_delta_net", linear=gdn)
        )
        layers.append(
            LayerSpec(**mixer, ffn="moe" if sparse else "dense", moe=moe if sparse else None)
        )
    cfg = dict(cfg)
    params = dict(cfg.get("rope_parameters") or {})
    factor = float(params.pop("partial_rotary_factor", cfg.pop("partial_rotary_factor", 0.25)))
    cfg["rope_parameters"] = params or None
    theta, scaling = rope_from_hf(cfg)
    return DecoderConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg["intermediate_size"],
        hidden_act=cfg.get("hidden_act", "silu"),
        norm="gemma_rmsnorm",
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=factor,
        attention_bias=bool(cfg.get("attention_bias", False)),
        attention_dropout=float(cfg.get("attention_dropout", 0.0) or 0.0),
        qk_norm=True,
        qk_norm_scope="head",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        **special_tokens(cfg),
        layers=tuple(layers),
        model_type="qwen3_next",
    )


def key_map(model: nn.Module) -> dict[str, str]:
    """attnlab keys -> transformers keys (the split query/gate rows under temporary names)."""
    return layer_key_map(model, _PARTS, final_norm="norm")


def _head_dim(config: DecoderConfig) -> int:
    assert config.head_dim is not None
    return config.head_dim


def weights_from_hf(weights: dict[str, Tensor], config: DecoderConfig) -> dict[str, Tensor]:
    """Split each ``self_attn.q_proj`` (per head: query rows, then gate rows) in two; stack
    per-expert tensors of a saved checkpoint; drop a tied head's copy."""
    out: dict[str, Tensor] = {}
    hd = _head_dim(config)
    for key, t in fuse_experts(weights, config).items():
        if key.endswith(".self_attn.q_proj.weight"):
            w = t.view(-1, 2, hd, t.shape[-1])  # [H, query|gate, h_d, D]
            base = key[: -len("q_proj.weight")]
            out[base + "q_proj_query.weight"] = w[:, 0].reshape(-1, t.shape[-1])
            out[base + "q_proj_gate.weight"] = w[:, 1].reshape(-1, t.shape[-1])
        else:
            out[key] = t
    return out


def weights_to_hf(weights: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """The inverse of :func:`weights_from_hf`, plus a tied head's copy."""
    assert isinstance(model, DecoderLM)
    hd = _head_dim(model.config)
    out: dict[str, Tensor] = {}
    for key, t in weights.items():
        if key.endswith(".q_proj_gate.weight"):
            continue
        if key.endswith(".q_proj_query.weight"):
            base = key[: -len("q_proj_query.weight")]
            gate = weights[base + "q_proj_gate.weight"]
            d = t.shape[-1]
            both = torch.stack((t.view(-1, hd, d), gate.view(-1, hd, d)), dim=1)
            out[base + "q_proj.weight"] = both.reshape(-1, d)
        else:
            out[key] = t
    return add_tied_head(out, model)


def _check(c: DecoderConfig) -> tuple[list[str], MoEConfig | None, LinearLayerConfig]:
    specs = c.layer_specs
    if any(s.mixer not in ("gated_attention", "gated_delta_net") for s in specs):
        raise ValueError(
            "Qwen3-Next has Gated DeltaNet or gated-attention layers, got "
            f"{sorted({s.mixer for s in specs})}"
        )
    gdns = linear_settings(c, "gated_delta_net")
    moes = {s.moe for s in specs if s.ffn == "moe"}
    if len(gdns) > 1 or len(moes) > 1 or any(s.ffn == "none" for s in specs):
        raise ValueError(
            "Qwen3-Next has one Gated DeltaNet setting, one MoE setting and a feed-forward "
            "in every layer"
        )
    moe = moes.pop() if moes else None
    if moe is not None and (
        moe.router != "softmax_topk"
        or moe.expert_mlp != "gated"
        or (moe.shared_expert_intermediate_size > 0) != moe.shared_expert_gate
    ):
        raise ValueError(
            "Qwen3-Next has gated experts, a softmax_topk router, a gated shared expert"
        )
    if (
        c.norm != "gemma_rmsnorm"
        or c.mlp != "gated"
        or c.position_embedding != "rope"
        or not (c.qk_norm and c.qk_norm_scope == "head")
        or c.mlp_bias
        or c.sliding_window is not None
        or (c.attention_out_bias is not None and c.attention_out_bias != c.attention_bias)
    ):
        raise ValueError(
            "Qwen3-Next is zero-centred RMSNorm, gated MLPs, RoPE, per-head QK-norm, global "
            "attention and one bias setting for q/k/v/o"
        )
    types = [FULL if s.mixer == "gated_attention" else LINEAR for s in specs]
    return types, moe, gdns.pop() if gdns else LinearLayerConfig()


def qwen3_next_to_hf(model: nn.Module) -> nn.Module:
    assert isinstance(model, DecoderLM)
    c = model.config
    types, moe, gdn = _check(c)
    tf = require_transformers()
    hk = gdn.num_heads or c.num_attention_heads
    dk = gdn.head_dim or c.head_dim
    cfg = tf.Qwen3NextConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        hidden_act=c.hidden_act,
        rms_norm_eps=c.norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        rope_parameters={"rope_type": "default"}
        | dict(c.rope_scaling or {})
        | {"rope_theta": c.rope_theta, "partial_rotary_factor": c.partial_rotary_factor},
        attention_bias=c.attention_bias,
        attention_dropout=c.attention_dropout,
        tie_word_embeddings=c.tie_word_embeddings,
        linear_conv_kernel_dim=gdn.conv_kernel,
        linear_key_head_dim=dk,
        linear_value_head_dim=gdn.value_head_dim or dk,
        linear_num_key_heads=hk,
        linear_num_value_heads=gdn.num_value_heads or hk,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(c.num_hidden_layers) if i not in c.moe_layers],
        num_experts=moe.num_experts if moe is not None else 1,
        num_experts_per_tok=moe.top_k if moe is not None else 1,
        moe_intermediate_size=moe.intermediate_size if moe is not None else 1,
        shared_expert_intermediate_size=moe.shared_expert_intermediate_size if moe else 0,
        norm_topk_prob=moe.norm_topk_prob if moe is not None else True,
        router_aux_loss_coef=moe.router_aux_loss_coef if moe is not None else 0.001,
        layer_types=types,
        **special_tokens_to_hf(c),
    )
    return tf.Qwen3NextForCausalLM(cfg)


QWEN3_NEXT = hybrid_converter(
    model_type="qwen3_next",
    hf_class="Qwen3NextForCausalLM",
    config_from_hf=qwen3_next_config,
    key_map=key_map,
    to_hf_model=qwen3_next_to_hf,
    mixer="gated_delta_net",
    weights_from_hf=weights_from_hf,
    weights_to_hf=weights_to_hf,
)
