"""Jamba (``"jamba"``) <-> :class:`DecoderLM` with a hybrid layout.

Jamba (Lieber et al., 2024, "Jamba: a hybrid Transformer-Mamba language model")
interleaves attention and Mamba layers and puts a mixture of experts in some feed-forwards:
layer ``i`` holds attention when ``i % attn_layer_period == attn_layer_offset`` (Mamba
otherwise) and an MoE feed-forward when ``i % expert_layer_period == expert_layer_offset``
(a gated MLP otherwise). In attnlab that is a ``DecoderConfig.layers`` layout of
``LayerSpec(mixer="attention" | "mamba", ffn="dense" | "moe")``; one
:class:`~attnlab.cache.base.ModelCache` holds a KV cache per attention layer and a
:class:`~attnlab.cache.recurrent.MambaState` per Mamba layer.

What maps to what:

* no position encoding (the Mamba layers carry order): ``position_embedding="none"``;
* the Mamba mixer is Mamba's with RMSNorms on the step-size input, ``B`` and ``C``
  (``MambaLayerConfig(inner_norms=True)``);
* the router is a softmax over all experts, the top-k weights not renormalised
  (``router="softmax_topk", norm_topk_prob=False``); the experts are batched as in
  transformers 5 (``experts.gate_up_proj [E, 2F, D]``, ``experts.down_proj [E, D, F]``).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.interop.hf import require_transformers
from attnlab.interop.hybrid import (
    hybrid_converter,
    layer_key_map,
    special_tokens,
    special_tokens_to_hf,
)
from attnlab.interop.llama import drop_tied_head
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.layout import LayerSpec, MambaLayerConfig, MoEConfig

__all__ = ["JAMBA"]

# attnlab sub-module path -> transformers sub-module path, within one layer
_PARTS = {
    "self_attn_norm": "input_layernorm",
    "ffn_norm": "pre_ff_layernorm",
    "self_attention.q_proj": "self_attn.q_proj",
    "self_attention.k_proj": "self_attn.k_proj",
    "self_attention.v_proj": "self_attn.v_proj",
    "self_attention.out_proj": "self_attn.o_proj",
    "self_attention.mixer": "mamba",  # every Mamba parameter keeps its transformers name
    "feed_forward.gate_proj": "feed_forward.gate_proj",
    "feed_forward.up_proj": "feed_forward.up_proj",
    "feed_forward.down_proj": "feed_forward.down_proj",
    "feed_forward.router": "feed_forward.router",
    "feed_forward.experts.w_in": "feed_forward.experts.gate_up_proj",
    "feed_forward.experts.w_out": "feed_forward.experts.down_proj",
}


def jamba_config(cfg: dict[str, Any], weight_names: set[str]) -> DecoderConfig:
    """The attnlab config of a transformers ``JambaConfig`` (as a dict)."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    n = cfg["num_hidden_layers"]
    experts = cfg.get("num_experts", cfg.get("num_local_experts", 16))
    moe = None
    if experts > 1:
        moe = MoEConfig(
            num_experts=experts,
            top_k=cfg["num_experts_per_tok"],
            intermediate_size=cfg["intermediate_size"],
            router="softmax_topk",
            norm_topk_prob=False,
            hidden_act=cfg.get("hidden_act", "silu"),
            router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
        )
    rank = cfg.get("mamba_dt_rank", "auto")
    mamba = MambaLayerConfig(
        state_size=cfg.get("mamba_d_state", 16),
        conv_kernel=cfg.get("mamba_d_conv", 4),
        expand=cfg.get("mamba_expand", 2),
        dt_rank=None if rank == "auto" else int(rank),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        inner_norms=True,
    )
    attn_p, attn_o = cfg.get("attn_layer_period", 8), cfg.get("attn_layer_offset", 4)
    exp_p, exp_o = cfg.get("expert_layer_period", 2), cfg.get("expert_layer_offset", 1)
    layers = []
    for i in range(n):
        attention = i % attn_p == attn_o
        sparse = moe is not None and i % exp_p == exp_o
        layers.append(
            LayerSpec(
                mixer="attention" if attention else "mamba",
                ffn="moe" if sparse else "dense",
                moe=moe if sparse else None,
                mamba=None if attention else mamba,
            )
        )
    return DecoderConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=h,
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=h // heads,
        intermediate_size=cfg["intermediate_size"],
        hidden_act=cfg.get("hidden_act", "silu"),
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        position_embedding="none",
        max_position_embeddings=cfg.get("max_position_embeddings", 262144),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_dropout=float(cfg.get("attention_dropout", 0.0)),
        **special_tokens(cfg),
        layers=tuple(layers),
    )


def key_map(model: nn.Module) -> dict[str, str]:
    """attnlab keys -> transformers keys."""
    return layer_key_map(model, _PARTS, final_norm="final_layernorm")


_PER_EXPERT = re.compile(
    r"^(?P<layer>model\.layers\.\d+)\.feed_forward\.experts\.(?P<e>\d+)\."
    r"(?P<w>gate_proj|up_proj|down_proj)\.weight$"
)


def weights_from_hf(weights: dict[str, Tensor], config: DecoderConfig) -> dict[str, Tensor]:
    """Saved Jamba checkpoints keep one tensor per expert (``feed_forward.experts.{e}.
    gate_proj/up_proj/down_proj``); transformers 5 and attnlab hold them batched: stack them
    into ``experts.gate_up_proj [E, 2F, D]`` (gate rows, then up rows) and ``experts.down_proj
    [E, D, F]``. Then drop a tied head's copy."""
    out: dict[str, Tensor] = {}
    grouped: dict[str, dict[int, dict[str, Tensor]]] = {}
    for key, t in weights.items():
        m = _PER_EXPERT.match(key)
        if m is None:
            out[key] = t
        else:
            grouped.setdefault(m["layer"], {}).setdefault(int(m["e"]), {})[m["w"]] = t
    for layer, experts in grouped.items():
        order = [experts[e] for e in sorted(experts)]
        out[f"{layer}.feed_forward.experts.gate_up_proj"] = torch.stack(
            [torch.cat([w["gate_proj"], w["up_proj"]]) for w in order]
        )
        out[f"{layer}.feed_forward.experts.down_proj"] = torch.stack(
            [w["down_proj"] for w in order]
        )
    return drop_tied_head(out, config)


def _period(flags: list[bool], what: str) -> tuple[int, int]:
    """``(period, offset)`` with ``flags[i] == (i % period == offset)``, else ValueError."""
    n = len(flags)
    for period in range(1, n + 1):
        for offset in range(period):
            if all(f == (i % period == offset) for i, f in enumerate(flags)):
                return period, offset
    raise ValueError(
        f"Jamba places its {what} every `period` layers from an offset; the layout "
        f"{['x' if f else '.' for f in flags]} has no such period"
    )


def _jamba_check(c: DecoderConfig) -> tuple[MambaLayerConfig, MoEConfig | None]:
    specs = c.layer_specs
    kinds = {s.mixer for s in specs}
    if not kinds <= {"attention", "mamba"} or "mamba" not in kinds:
        raise ValueError(f"Jamba mixes attention and Mamba layers, got mixers {sorted(kinds)}")
    mambas = {s.mamba or MambaLayerConfig() for s in specs if s.mixer == "mamba"}
    moes = {s.moe for s in specs if s.ffn == "moe"}
    if len(mambas) != 1 or len(moes) > 1 or any(s.ffn == "none" for s in specs):
        raise ValueError(
            "Jamba has one Mamba setting, one MoE setting and a feed-forward in every layer"
        )
    mamba = mambas.pop()
    moe = moes.pop() if moes else None
    if not mamba.inner_norms:
        raise ValueError(
            "Jamba's Mamba layers norm dt, B and C (MambaLayerConfig(inner_norms=True))"
        )
    if moe is not None and (
        moe.router != "softmax_topk" or moe.norm_topk_prob or moe.expert_mlp != "gated"
    ):
        raise ValueError(
            "Jamba's experts are gated with a softmax_topk router, top-k not renormalised"
        )
    if moe is not None and moe.intermediate_size != c.intermediate_size:
        raise ValueError(
            f"Jamba's experts and dense MLPs share intermediate_size, got {moe.intermediate_size} "
            f"and {c.intermediate_size}"
        )
    if (
        c.position_embedding != "none"
        or c.norm != "rmsnorm"
        or c.mlp != "gated"
        or c.attention_bias
        or c.head_dim != c.hidden_size // c.num_attention_heads
    ):
        raise ValueError(
            "Jamba is RMSNorm + gated MLPs, attention without positions or biases and "
            "head_dim = hidden_size / num_attention_heads"
        )
    return mamba, moe


def jamba_to_hf(model: nn.Module) -> nn.Module:
    assert isinstance(model, DecoderLM)
    c = model.config
    mamba, moe = _jamba_check(c)
    attn_p, attn_o = _period([s.mixer == "attention" for s in c.layer_specs], "attention layers")
    if moe is not None:
        exp_p, exp_o = _period([s.ffn == "moe" for s in c.layer_specs], "MoE feed-forwards")
    else:
        exp_p, exp_o = 1, 0
    tf = require_transformers()
    cfg = tf.JambaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        hidden_act=c.hidden_act,
        rms_norm_eps=c.norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
        attention_dropout=c.attention_dropout,
        num_experts=moe.num_experts if moe is not None else 1,
        num_experts_per_tok=moe.top_k if moe is not None else 1,
        router_aux_loss_coef=moe.router_aux_loss_coef if moe is not None else 0.001,
        expert_layer_period=exp_p,
        expert_layer_offset=exp_o,
        attn_layer_period=attn_p,
        attn_layer_offset=attn_o,
        mamba_d_state=mamba.state_size,
        mamba_d_conv=mamba.conv_kernel,
        mamba_expand=mamba.expand,
        mamba_dt_rank=mamba.rank(c.hidden_size),
        mamba_conv_bias=mamba.conv_bias,
        mamba_proj_bias=mamba.proj_bias,
        **special_tokens_to_hf(c),
    )
    return tf.JambaForCausalLM(cfg)


def _is_jamba(model: Any) -> bool:
    return isinstance(model, DecoderLM) and any(
        s.mixer == "mamba" for s in model.config.layer_specs
    )


JAMBA = hybrid_converter(
    model_type="jamba",
    hf_class="JambaForCausalLM",
    config_from_hf=jamba_config,
    key_map=key_map,
    to_hf_model=jamba_to_hf,
    mixer="mamba",
    weights_from_hf=weights_from_hf,
    accepts=_is_jamba,
)
