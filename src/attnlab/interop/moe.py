"""Mixtral, Qwen2-MoE, OLMoE and Qwen3-MoE <-> :class:`DecoderLM` with MoE layers.

All four are Llama-style decoders (RoPE, RMSNorm, GQA) whose feed-forward is a mixture
of SwiGLU experts with a ``softmax_topk`` router; transformers 5 stores the experts
batched (``mlp.experts.gate_up_proj [E, 2F, D]``, ``mlp.experts.down_proj [E, D, F]``),
the layout of :class:`~attnlab.modules.experts.Experts`, so weights map one to one.

* Mixtral (Jiang et al., 2024): every layer MoE, top-k renormalised, optional sliding
  window. transformers applies ``router_jitter_noise`` to the whole block's input in
  training; attnlab's ``router_jitter`` to the router's input only (Switch, sec. 2.4):
  inference is identical.
* Qwen2-MoE: q/k/v biases, a gated shared expert per MoE layer, dense layers where
  ``mlp_only_layers``/``decoder_sparse_step`` say so (a per-layer layout).
* OLMoE (Muennighoff et al., 2024): RMSNorm over the whole query and key projections
  (``qk_norm``), top-k not renormalised by default.
* Qwen3-MoE (Qwen team, 2025): RMSNorm per head on queries and keys
  (``qk_norm_scope="head"``), no shared expert, top-k renormalised when
  ``norm_topk_prob``, dense layers where ``mlp_only_layers``/``decoder_sparse_step`` say.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.interop.hf import Converter, register_converter, require_transformers
from attnlab.interop.llama import add_tied_head, claims, drop_tied_head, rope_to_hf
from attnlab.interop.llama import decoder_fields as _common
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.layout import LayerSpec, MoEConfig

__all__ = ["MIXTRAL", "OLMOE", "QWEN2_MOE", "QWEN3_MOE"]


def _moe(cfg: dict[str, Any], *, num_experts: int, width: int, **extra: Any) -> MoEConfig:
    return MoEConfig(
        num_experts=num_experts,
        top_k=cfg["num_experts_per_tok"],
        intermediate_size=width,
        hidden_act=cfg.get("hidden_act", "silu"),
        router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
        **extra,
    )


def mixtral_config(cfg: dict[str, Any], weight_names: set[str]) -> DecoderConfig:
    moe = _moe(
        cfg,
        num_experts=cfg["num_local_experts"],
        width=cfg["intermediate_size"],
        norm_topk_prob=True,
        router_jitter=float(cfg.get("router_jitter_noise", 0.0) or 0.0),
    )
    n = cfg["num_hidden_layers"]
    return DecoderConfig(
        **_common(cfg),
        sliding_window=cfg.get("sliding_window"),
        layers=(LayerSpec(ffn="moe", moe=moe),) * n,
    )


def qwen2_moe_config(cfg: dict[str, Any], weight_names: set[str]) -> DecoderConfig:
    if cfg.get("use_sliding_window"):
        raise ValueError(
            "Qwen2-MoE with use_sliding_window=True (per-layer windows) is not supported"
        )
    shared = cfg.get("shared_expert_intermediate_size", 0)
    moe = _moe(
        cfg,
        num_experts=cfg["num_experts"],
        width=cfg["moe_intermediate_size"],
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=shared,
        shared_expert_gate=bool(shared),
    )
    dense_only = set(cfg.get("mlp_only_layers") or [])
    step = cfg.get("decoder_sparse_step", 1) or 1
    layers = tuple(
        LayerSpec(ffn="moe", moe=moe)
        if i not in dense_only and cfg["num_experts"] > 0 and (i + 1) % step == 0
        else LayerSpec()
        for i in range(cfg["num_hidden_layers"])
    )
    bias = bool(cfg.get("qkv_bias", True))
    return DecoderConfig(
        **_common(cfg), attention_bias=bias, attention_out_bias=False, layers=layers
    )


def olmoe_config(cfg: dict[str, Any], weight_names: set[str]) -> DecoderConfig:
    if cfg.get("clip_qkv") is not None:
        raise ValueError(f"OLMoE with clip_qkv={cfg['clip_qkv']} is not supported")
    moe = _moe(
        cfg,
        num_experts=cfg["num_experts"],
        width=cfg["intermediate_size"],
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
    )
    return DecoderConfig(
        **_common(cfg),
        attention_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=True,
        layers=(LayerSpec(ffn="moe", moe=moe),) * cfg["num_hidden_layers"],
    )


def qwen3_moe_config(cfg: dict[str, Any], weight_names: set[str]) -> DecoderConfig:
    # transformers 5 writes num_experts as num_local_experts (an attribute map)
    experts = cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]
    moe = _moe(
        cfg,
        num_experts=experts,
        width=cfg["moe_intermediate_size"],
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
    )
    dense_only = set(cfg.get("mlp_only_layers") or [])
    step = cfg.get("decoder_sparse_step", 1) or 1
    layers = tuple(
        LayerSpec(ffn="moe", moe=moe)
        if i not in dense_only and experts > 0 and (i + 1) % step == 0
        else LayerSpec()
        for i in range(cfg["num_hidden_layers"])
    )
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    return DecoderConfig(
        **_common(cfg),
        attention_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=True,
        qk_norm_scope="head",
        sliding_window=window,
        layers=layers,
        model_type="qwen3_moe",
    )


def key_map(model: nn.Module) -> dict[str, str]:
    """attnlab keys -> transformers keys for the three architectures."""
    assert isinstance(model, DecoderLM)
    own = model.state_dict()
    m = {"embed_tokens.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if model.lm_head is not None:
        m["lm_head.weight"] = "lm_head.weight"
    parts = {
        "self_attention.q_proj": "self_attn.q_proj",
        "self_attention.k_proj": "self_attn.k_proj",
        "self_attention.v_proj": "self_attn.v_proj",
        "self_attention.out_proj": "self_attn.o_proj",
        "self_attention.q_norm": "self_attn.q_norm",  # OLMoE: over the projection
        "self_attention.k_norm": "self_attn.k_norm",
        "self_attention.q_norm.norm": "self_attn.q_norm",  # Qwen3-MoE: per head
        "self_attention.k_norm.norm": "self_attn.k_norm",
        "self_attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        # dense layers (Qwen2-MoE's mlp_only_layers) and shared experts
        "feed_forward.gate_proj": "mlp.gate_proj",
        "feed_forward.up_proj": "mlp.up_proj",
        "feed_forward.down_proj": "mlp.down_proj",
        "feed_forward.router": "mlp.gate",
        "feed_forward.shared_expert.gate_proj": "mlp.shared_expert.gate_proj",
        "feed_forward.shared_expert.up_proj": "mlp.shared_expert.up_proj",
        "feed_forward.shared_expert.down_proj": "mlp.shared_expert.down_proj",
        "feed_forward.shared_expert_gate": "mlp.shared_expert_gate",
        # batched experts: parameters without a ".weight" suffix
        "feed_forward.experts.w_in": "mlp.experts.gate_up_proj",
        "feed_forward.experts.w_out": "mlp.experts.down_proj",
    }
    for i in range(len(model.layers)):
        for ours, theirs in parts.items():
            for kind in (".weight", ".bias", ""):
                key = f"layers.{i}.{ours}{kind}"
                if key in own:
                    m[key] = f"model.layers.{i}.{theirs}{kind}"
    return m


def _uniform_moe(c: DecoderConfig, arch: str) -> MoEConfig:
    """The one MoEConfig every MoE layer shares (transformers has one per model)."""
    specs = {c.layer_specs[i].moe for i in c.moe_layers}
    if len(specs) != 1:
        raise ValueError(f"{arch} has one MoE setting for all layers, got {len(specs)}")
    moe = specs.pop()
    assert moe is not None
    if moe.expert_mlp != "gated" or moe.router != "softmax_topk":
        raise ValueError(
            f"{arch} has gated experts and a softmax_topk router, got expert_mlp="
            f"{moe.expert_mlp!r}, router={moe.router!r}"
        )
    if c.position_embedding != "rope" or c.norm != "rmsnorm" or c.mlp != "gated":
        raise ValueError(f"{arch} is RoPE + RMSNorm + gated MLPs")
    if any(s.mixer != "attention" for s in c.layer_specs):
        raise ValueError(f"{arch} has attention in every layer")
    return moe


def _base_kwargs(c: DecoderConfig) -> dict[str, Any]:
    return dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        hidden_act=c.hidden_act,
        rms_norm_eps=c.norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        rope_parameters=rope_to_hf(c),
        tie_word_embeddings=c.tie_word_embeddings,
        attention_dropout=c.attention_dropout,
        pad_token_id=c.pad_token_id,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
    )


def mixtral_to_hf(model: nn.Module) -> nn.Module:
    assert isinstance(model, DecoderLM)
    c = model.config
    moe = _uniform_moe(c, "Mixtral")
    if len(c.moe_layers) != c.num_hidden_layers or not moe.norm_topk_prob:
        raise ValueError("Mixtral has MoE in every layer with renormalised top-k weights")
    tf = require_transformers()
    cfg = tf.MixtralConfig(
        **_base_kwargs(c),
        intermediate_size=moe.intermediate_size,
        num_local_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        sliding_window=c.sliding_window,
        router_aux_loss_coef=moe.router_aux_loss_coef,
        router_jitter_noise=moe.router_jitter,
    )
    return tf.MixtralForCausalLM(cfg)


def qwen2_moe_to_hf(model: nn.Module) -> nn.Module:
    assert isinstance(model, DecoderLM)
    c = model.config
    moe = _uniform_moe(c, "Qwen2-MoE")
    if not (moe.shared_expert_intermediate_size and moe.shared_expert_gate):
        raise ValueError("Qwen2-MoE has a gated shared expert in every MoE layer")
    tf = require_transformers()
    cfg = tf.Qwen2MoeConfig(
        **_base_kwargs(c),
        intermediate_size=c.intermediate_size,
        moe_intermediate_size=moe.intermediate_size,
        shared_expert_intermediate_size=moe.shared_expert_intermediate_size,
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        norm_topk_prob=moe.norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(c.num_hidden_layers) if i not in c.moe_layers],
        qkv_bias=c.attention_bias,
        router_aux_loss_coef=moe.router_aux_loss_coef,
    )
    return tf.Qwen2MoeForCausalLM(cfg)


def olmoe_to_hf(model: nn.Module) -> nn.Module:
    assert isinstance(model, DecoderLM)
    c = model.config
    moe = _uniform_moe(c, "OLMoE")
    tf = require_transformers()
    cfg = tf.OlmoeConfig(
        **_base_kwargs(c),
        intermediate_size=moe.intermediate_size,
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        norm_topk_prob=moe.norm_topk_prob,
        attention_bias=c.attention_bias,
        router_aux_loss_coef=moe.router_aux_loss_coef,
    )
    return tf.OlmoeForCausalLM(cfg)


def qwen3_moe_to_hf(model: nn.Module) -> nn.Module:
    assert isinstance(model, DecoderLM)
    c = model.config
    moe = _uniform_moe(c, "Qwen3-MoE")
    if moe.shared_expert_intermediate_size or not (c.qk_norm and c.qk_norm_scope == "head"):
        raise ValueError("Qwen3-MoE has per-head QK-norm and no shared expert")
    tf = require_transformers()
    cfg = tf.Qwen3MoeConfig(
        **_base_kwargs(c),
        intermediate_size=c.intermediate_size,
        moe_intermediate_size=moe.intermediate_size,
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        norm_topk_prob=moe.norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(c.num_hidden_layers) if i not in c.moe_layers],
        attention_bias=c.attention_bias,
        use_sliding_window=c.sliding_window is not None,
        sliding_window=c.sliding_window,
        router_aux_loss_coef=moe.router_aux_loss_coef,
    )
    return tf.Qwen3MoeForCausalLM(cfg)


_PER_EXPERT = re.compile(
    r"^(?P<layer>model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(?P<e>\d+)\."
    r"(?P<w>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_ROLE = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down"}
_ROLE["down_proj"] = "down"


def fuse_experts(weights: dict[str, Tensor], config: DecoderConfig) -> dict[str, Tensor]:
    """Checkpoints on disk keep one tensor per expert (Mixtral's ``block_sparse_moe.experts.
    {e}.w1/w3/w2``, Qwen2-MoE's and OLMoE's ``mlp.experts.{e}.gate_proj/up_proj/down_proj``);
    transformers 5 and attnlab hold them batched. Stack them into ``mlp.experts.gate_up_proj
    [E, 2F, D]`` (gate rows, then up rows) and ``mlp.experts.down_proj [E, D, F]``, and name
    Mixtral's router ``mlp.gate``; then drop a tied head's copy."""
    out: dict[str, Tensor] = {}
    grouped: dict[str, dict[int, dict[str, Tensor]]] = {}
    for key, t in weights.items():
        m = _PER_EXPERT.match(key)
        if m is None:
            out[key.replace(".block_sparse_moe.gate.", ".mlp.gate.")] = t
            continue
        grouped.setdefault(m["layer"], {}).setdefault(int(m["e"]), {})[_ROLE[m["w"]]] = t
    for layer, experts in grouped.items():
        order = [experts[e] for e in sorted(experts)]
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([w["gate"], w["up"]]) for w in order]
        )
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack([w["down"] for w in order])
    return drop_tied_head(out, config)


def _kind(c: DecoderConfig) -> str | None:
    """Which of the four a DecoderLM with MoE layers looks like."""
    if not c.moe_layers:
        return None
    if c.qk_norm:
        return "qwen3_moe" if c.qk_norm_scope == "head" else "olmoe"
    moe = c.layer_specs[c.moe_layers[0]].moe
    assert moe is not None
    return "qwen2_moe" if moe.shared_expert_intermediate_size else "mixtral"


def _converter(model_type: str, hf_class: str, config_from_hf: Any, to_hf: Any) -> Converter:
    return register_converter(
        Converter(
            model_type=model_type,
            hf_classes={hf_class: ""},
            attnlab_class=DecoderLM,
            config_from_hf=config_from_hf,
            build=DecoderLM,
            key_map=key_map,
            to_hf_model=to_hf,
            weights_from_hf=fuse_experts,
            weights_to_hf=add_tied_head,
            accepts=lambda m: claims(m, model_type, lambda c: _kind(c) == model_type),
        )
    )


MIXTRAL = _converter("mixtral", "MixtralForCausalLM", mixtral_config, mixtral_to_hf)
QWEN2_MOE = _converter("qwen2_moe", "Qwen2MoeForCausalLM", qwen2_moe_config, qwen2_moe_to_hf)
OLMOE = _converter("olmoe", "OlmoeForCausalLM", olmoe_config, olmoe_to_hf)
QWEN3_MOE = _converter("qwen3_moe", "Qwen3MoeForCausalLM", qwen3_moe_config, qwen3_moe_to_hf)
