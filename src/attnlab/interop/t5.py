"""T5 (``model_type == "t5"``) <-> :class:`~attnlab.models.seq2seq.Seq2SeqLM`.

T5 keeps its relative position bias in the first block of each stack; attnlab shares
one bias module across a stack, so every layer's copy maps to that one tensor.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from attnlab.interop.hf import Converter, register_converter, require_transformers
from attnlab.models.seq2seq import Seq2SeqLM
from attnlab.models.seq2seq_config import Seq2SeqConfig

_TIED = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


def _feed_forward(proj: str) -> tuple[str, str]:
    """``(mlp, activation)`` from T5's ``feed_forward_proj`` ("relu", "gated-gelu", ...)."""
    parts = proj.split("-")
    gated = parts[0] == "gated"
    act = parts[-1]
    if len(parts) > 2 or (len(parts) == 2 and not gated):
        raise ValueError(
            f"feed_forward_proj {proj!r} is not understood; expected 'relu' or 'gated-gelu'"
        )
    if act == "gelu" and gated:
        act = "gelu_new"  # transformers maps "gated-gelu" to the tanh approximation
    return ("gated" if gated else "standard"), act


def config_from_hf(cfg: dict[str, Any], weight_names: set[str]) -> Seq2SeqConfig:
    mlp, act = _feed_forward(cfg.get("feed_forward_proj", "relu"))
    return Seq2SeqConfig.t5(
        vocab_size=cfg["vocab_size"],
        d_model=cfg["d_model"],
        num_heads=cfg["num_heads"],
        d_kv=cfg["d_kv"],
        d_ff=cfg["d_ff"],
        num_layers=cfg["num_layers"],
        num_decoder_layers=cfg.get("num_decoder_layers") or cfg["num_layers"],
        relative_attention_num_buckets=cfg.get("relative_attention_num_buckets", 32),
        relative_attention_max_distance=cfg.get("relative_attention_max_distance", 128),
        layer_norm_epsilon=cfg.get("layer_norm_epsilon", 1e-6),
        mlp=mlp,
        dense_act_fn=act,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        dropout_rate=cfg.get("dropout_rate", 0.0),
        pad_token_id=cfg.get("pad_token_id", 0),
        eos_token_id=cfg.get("eos_token_id", 1),
        decoder_start_token_id=cfg.get("decoder_start_token_id", 0) or 0,
    )


def key_map(model: nn.Module) -> dict[str, str]:
    assert isinstance(model, Seq2SeqLM)
    m = {"shared.weight": "shared.weight"}
    if model.lm_head is not None:
        m["lm_head.weight"] = "lm_head.weight"
    m["encoder_norm.weight"] = "encoder.final_layer_norm.weight"
    m["decoder_norm.weight"] = "decoder.final_layer_norm.weight"
    m["encoder_bias.relative_attention_bias.weight"] = (
        "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    )
    m["decoder_bias.relative_attention_bias.weight"] = (
        "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    )
    gated = model.config.mlp == "gated"
    ff = (
        {"gate_proj": "wi_0", "up_proj": "wi_1", "down_proj": "wo"}
        if gated
        else {"fc_in": "wi", "fc_out": "wo"}
    )
    proj = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "out_proj": "o"}
    for i in range(len(model.encoder_layers)):
        e, t = f"encoder_layers.{i}", f"encoder.block.{i}.layer"
        for ours, theirs in proj.items():
            m[f"{e}.attention.{ours}.weight"] = f"{t}.0.SelfAttention.{theirs}.weight"
        m[f"{e}.attn_norm.weight"] = f"{t}.0.layer_norm.weight"
        for ours, theirs in ff.items():
            m[f"{e}.feed_forward.{ours}.weight"] = f"{t}.1.DenseReluDense.{theirs}.weight"
        m[f"{e}.ffn_norm.weight"] = f"{t}.1.layer_norm.weight"
    for i in range(len(model.decoder_layers)):
        d, t = f"decoder_layers.{i}", f"decoder.block.{i}.layer"
        for ours, theirs in proj.items():
            m[f"{d}.self_attention.{ours}.weight"] = f"{t}.0.SelfAttention.{theirs}.weight"
            m[f"{d}.cross_attention.{ours}.weight"] = f"{t}.1.EncDecAttention.{theirs}.weight"
        m[f"{d}.self_attn_norm.weight"] = f"{t}.0.layer_norm.weight"
        m[f"{d}.cross_attn_norm.weight"] = f"{t}.1.layer_norm.weight"
        for ours, theirs in ff.items():
            m[f"{d}.feed_forward.{ours}.weight"] = f"{t}.2.DenseReluDense.{theirs}.weight"
        m[f"{d}.ffn_norm.weight"] = f"{t}.2.layer_norm.weight"
    return m


def weights_from_hf(weights: dict[str, Tensor], config: Seq2SeqConfig) -> dict[str, Tensor]:
    """Drop the tied copies of the shared embeddings (and of a tied head)."""
    drop = set(_TIED) | ({"lm_head.weight"} if config.tie_word_embeddings else set())
    return {k: v for k, v in weights.items() if k not in drop}


def weights_to_hf(weights: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    assert isinstance(model, Seq2SeqLM)
    out = dict(weights)
    shared = model.shared.weight.detach()
    for k in _TIED:
        out[k] = shared
    if model.lm_head is None:
        out["lm_head.weight"] = shared
    return out


def to_hf_model(model: nn.Module) -> nn.Module:
    assert isinstance(model, Seq2SeqLM)
    c = model.config
    if (
        c.position_embedding != "t5_relative"
        or c.norm != "rmsnorm"
        or c.norm_position != "pre"
        or c.bias
        or c.attention_scale != 1.0
        or c.scale_embeddings
        or c.rescale_output != c.tie_word_embeddings
    ):
        raise ValueError(
            "T5 has relative position bias, pre-LN RMS norms, no biases and unscaled scores; "
            f"this Seq2SeqLM has position_embedding={c.position_embedding!r}, norm={c.norm!r}, "
            f"norm_position={c.norm_position!r}, bias={c.bias}, attention_scale={c.attention_scale}"
        )
    if c.mlp == "gated":
        if c.dense_act_fn != "gelu_new":
            raise ValueError(f"T5's gated feed-forward uses gelu_new, got {c.dense_act_fn!r}")
        proj = "gated-gelu"
    else:
        proj = c.dense_act_fn
    tf = require_transformers()
    cfg = tf.T5Config(
        vocab_size=c.vocab_size,
        d_model=c.d_model,
        d_kv=c.d_kv,
        d_ff=c.d_ff,
        num_layers=c.num_layers,
        num_decoder_layers=c.num_decoder_layers,
        num_heads=c.num_heads,
        relative_attention_num_buckets=c.relative_attention_num_buckets,
        relative_attention_max_distance=c.relative_attention_max_distance,
        dropout_rate=c.dropout_rate,
        layer_norm_epsilon=c.layer_norm_epsilon,
        feed_forward_proj=proj,
        tie_word_embeddings=c.tie_word_embeddings,
        pad_token_id=c.pad_token_id,
        eos_token_id=c.eos_token_id,
        decoder_start_token_id=c.decoder_start_token_id,
    )
    return tf.T5ForConditionalGeneration(cfg)


T5 = register_converter(
    Converter(
        model_type="t5",
        hf_classes={"T5ForConditionalGeneration": ""},
        attnlab_class=Seq2SeqLM,
        config_from_hf=config_from_hf,
        build=Seq2SeqLM,
        key_map=key_map,
        to_hf_model=to_hf_model,
        weights_from_hf=weights_from_hf,
        weights_to_hf=weights_to_hf,
    )
)
