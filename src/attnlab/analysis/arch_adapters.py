"""The cost model's adapters of attnlab's own configs: each config to an :class:`ArchSpec`.

:func:`attnlab.analysis.arch.describe` registers these lazily (no work at import):
:func:`encoder_spec` (``EncoderConfig``: BERT, RoBERTa, ModernBERT's local layers as
two-sided windows), :func:`decoder_spec` (``DecoderConfig``: Llama to Gemma, per-layer
windows kept in ``layer_windows``, MoE layers), :func:`seq2seq_spec` (``Seq2SeqConfig``).
"""

from __future__ import annotations

from typing import Any

from attnlab.analysis.arch import ArchSpec, MoESpec

__all__ = ["decoder_spec", "encoder_spec", "seq2seq_spec"]


def _layer_windows(windows: tuple[int | None, ...]) -> tuple[int | None, ...] | None:
    """The per-layer windows when they differ, else None (uniform layers)."""
    return windows if len(set(windows)) > 1 else None


def encoder_spec(config: Any) -> ArchSpec:
    local = tuple(config.local_attention or ())
    uniform = local[0] if local and _layer_windows(local) is None else None
    kind = config.position_embedding_type  # absolute and roberta: a learned table
    position = "learned" if kind in ("absolute", "roberta") else kind
    return ArchSpec(
        name="encoder",
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        ffn="gated" if config.mlp == "gated" else "standard",
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        activation=config.hidden_act,
        attention_bias=config.attention_bias,
        attention_out_bias=config.attention_bias,
        mlp_bias=config.mlp_bias,
        causal=False,
        position=position,
        max_positions=config.max_position_embeddings,
        learned_positions=position == "learned",
        type_vocab_size=config.type_vocab_size,
        norm="layernorm",
        embedding_norm=True,
        final_norm=config.norm_position == "pre",
        lm_head=False,
        pooler=config.add_pooler,
        attention_dropout=config.attention_probs_dropout_prob,
        hidden_dropout=config.hidden_dropout_prob,
        window=uniform,
        layer_windows=_layer_windows(local) if local else None,
    )


def _ffn_name(config: Any) -> str:
    moe = _moe_spec(config)
    if moe is None:
        return str(config.mlp)
    return f"MoE {moe.num_experts}x top-{moe.top_k} in {moe.num_layers} layers"


def decoder_spec(config: Any) -> ArchSpec:
    mixers = sorted({spec.mixer for spec in config.layer_specs})
    if mixers != ["attention"]:
        # an ArchSpec describes uniform attention layers: costing a hybrid's Mamba layers as
        # attention would be wrong (parameters, FLOPs, and a KV cache they do not keep)
        raise ValueError(
            f"the cost model covers attention decoders (and, through estimate_recurrent, "
            f"pure state-space models); this layout mixes {mixers} layers, a hybrid it does "
            "not estimate"
        )
    windows = tuple(config.layer_window(i) for i in range(config.num_hidden_layers))
    mixed = _layer_windows(windows)
    pos = config.position_embedding
    out_bias = config.attention_out_bias
    return ArchSpec(
        name=f"decoder ({pos}, {_ffn_name(config)} FFN"
        + (
            f", window {windows[0]})"
            if windows[0] is not None and mixed is None
            else f", windows {sorted(w for w in set(windows) if w)} on {sum(w is not None for w in windows)} of {len(windows)} layers)"
            if mixed is not None
            else ")"
        ),
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        ffn="gated" if config.mlp == "gated" else "standard",
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        activation=config.hidden_act,
        causal=True,
        position=pos,
        max_positions=config.max_position_embeddings,
        learned_positions=pos == "learned",
        type_vocab_size=0,
        norm="rmsnorm" if config.norm == "rmsnorm" else "layernorm",
        embedding_norm=config.embedding_norm,
        final_norm=True,
        attention_bias=config.attention_bias,
        attention_out_bias=config.attention_bias if out_bias is None else out_bias,
        mlp_bias=config.mlp_bias,
        lm_head=True,
        tied_embeddings=config.tie_word_embeddings,
        window=windows[0] if mixed is None else None,
        layer_windows=mixed,
        attention_dropout=config.attention_dropout,
        hidden_dropout=config.hidden_dropout,
        moe=_moe_spec(config),
        extra_parameters=_extra_norm_parameters(config),
    )


def _extra_norm_parameters(config: Any) -> int:
    """Norm weights beyond one per sublayer: QK-norm (per channel of the projection, OLMoE;
    or per head feature, shared by the heads, Qwen3) and the sandwich's two output norms
    (Gemma 2 and 3)."""
    n, d = config.num_hidden_layers, config.hidden_size
    qk = 0
    if config.qk_norm:
        heads = config.num_attention_heads + config.num_key_value_heads
        qk = 2 * config.head_dim if config.qk_norm_scope == "head" else heads * config.head_dim
    sandwich = 2 * d if config.norm_placement == "sandwich" else 0
    return n * (qk + sandwich)


def _moe_spec(config: Any) -> MoESpec | None:
    """The MoE layers of a ``DecoderConfig`` (the first MoE layer's settings stand for all)."""
    layers = getattr(config, "moe_layers", None)
    if not layers:
        return None
    moe = config.layer_specs[layers[0]].moe
    return MoESpec(
        num_layers=len(layers),
        num_experts=moe.num_experts,
        top_k=moe.top_k,
        intermediate_size=moe.intermediate_size,
        gated=moe.expert_mlp == "gated",
        activation=moe.hidden_act,
        shared_intermediate_size=moe.shared_expert_intermediate_size,
        shared_gate=moe.shared_expert_gate,
    )


def seq2seq_spec(config: Any) -> ArchSpec:
    pos = config.position_embedding
    relative = pos == "t5_relative"
    return ArchSpec(
        name=f"encoder-decoder ({pos})",
        num_layers=config.num_layers,
        hidden_size=config.d_model,
        num_heads=config.num_heads,
        num_kv_heads=config.num_heads,
        head_dim=config.d_kv,
        ffn="gated" if config.mlp == "gated" else "standard",
        intermediate_size=config.d_ff,
        vocab_size=config.vocab_size,
        activation=config.dense_act_fn,
        causal=False,
        position="relative" if relative else pos,
        max_positions=config.max_position_embeddings,
        learned_positions=pos == "learned",
        norm="rmsnorm" if config.norm == "rmsnorm" else "layernorm",
        final_norm=config.norm_position == "pre",
        attention_bias=config.bias,
        attention_out_bias=config.bias,
        mlp_bias=config.bias,
        lm_head=True,
        tied_embeddings=config.tie_word_embeddings,
        num_decoder_layers=config.num_decoder_layers,
        hidden_dropout=config.dropout_rate,
        # one bucket table per stack (encoder: bidirectional, decoder: causal)
        extra_parameters=2 * config.relative_attention_num_buckets * config.num_heads
        if relative
        else 0,
    )
