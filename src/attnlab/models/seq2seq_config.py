"""Config of encoder-decoder Transformers: the original Transformer's shape and T5's.

Field names follow transformers' ``T5Config``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from attnlab.functional._checks import check_positive_int, check_probability, check_real
from attnlab.models._base import ConfigBase
from attnlab.modules.activations import activation_names

__all__ = ["Seq2SeqConfig"]

POSITIONS = ("t5_relative", "sinusoidal", "learned")


@dataclass
class Seq2SeqConfig(ConfigBase):
    """An encoder-decoder Transformer with cross-attention (Vaswani et al., 2017).

    Attributes:
        vocab_size: shared vocabulary of encoder and decoder.
        d_model: width ``D``.
        num_heads: heads per attention.
        d_kv: per-head width; default ``d_model // num_heads``.
        d_ff: feed-forward inner width.
        num_layers: encoder layers.
        num_decoder_layers: decoder layers (default ``num_layers``).
        position_embedding: ``"t5_relative"`` (T5's bucketed bias, Raffel et al., 2020),
            ``"sinusoidal"`` (the original) or ``"learned"``.
        relative_attention_num_buckets: T5 buckets.
        relative_attention_max_distance: T5's farthest distinguished distance.
        max_position_embeddings: table size of sinusoidal/learned positions.
        norm: ``"rmsnorm"`` (T5) or ``"layernorm"``.
        norm_position: ``"pre"`` (T5) or ``"post"`` (the original).
        layer_norm_epsilon: norm epsilon.
        mlp: ``"standard"`` or ``"gated"``; ``dense_act_fn``: its activation.
        bias: biases on the attention and feed-forward projections (T5 has none).
        attention_scale: score scale; None for ``1/sqrt(d_kv)``; T5 uses 1.0 (its
            initialisation absorbs the scale).
        scale_embeddings: multiply token embeddings by ``sqrt(d_model)`` (the original).
        tie_word_embeddings: the LM head reuses the shared embeddings.
        rescale_output: multiply the decoder output by ``d_model**-0.5`` before a tied
            head (T5).
        dropout_rate: dropout on embeddings and sublayer outputs.
        pad_token_id, eos_token_id, decoder_start_token_id: special tokens.
        gradient_checkpointing: recompute each layer in the backward instead of keeping
            its activations (training only).
    """

    vocab_size: int = 32128
    d_model: int = 512
    num_heads: int = 8
    d_kv: int | None = None
    d_ff: int = 2048
    num_layers: int = 6
    num_decoder_layers: int | None = None
    position_embedding: str = "t5_relative"
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    max_position_embeddings: int = 512
    norm: str = "rmsnorm"
    norm_position: str = "pre"
    layer_norm_epsilon: float = 1e-6
    mlp: str = "standard"
    dense_act_fn: str = "relu"
    bias: bool = False
    attention_scale: float | None = 1.0
    scale_embeddings: bool = False
    tie_word_embeddings: bool = True
    rescale_output: bool = True
    dropout_rate: float = 0.0
    pad_token_id: int = 0
    eos_token_id: int | None = 1
    decoder_start_token_id: int = 0
    gradient_checkpointing: bool = False

    def __post_init__(self) -> None:
        self._check_positive_ints("vocab_size", "d_model", "num_heads", "d_ff", "num_layers")
        if self.num_decoder_layers is None:
            self.num_decoder_layers = self.num_layers
        check_positive_int("num_decoder_layers", self.num_decoder_layers)
        if self.d_kv is None:
            if self.d_model % self.num_heads:
                raise ValueError(
                    f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads}), "
                    "or set d_kv"
                )
            self.d_kv = self.d_model // self.num_heads
        check_positive_int("d_kv", self.d_kv)
        for name, value, allowed in (
            ("position_embedding", self.position_embedding, POSITIONS),
            ("norm", self.norm, ("rmsnorm", "layernorm")),
            ("norm_position", self.norm_position, ("pre", "post")),
            ("mlp", self.mlp, ("standard", "gated")),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
        if self.dense_act_fn not in activation_names():
            raise ValueError(
                f"unknown dense_act_fn {self.dense_act_fn!r}; known: {activation_names()}"
            )
        self._check_positive_ints(
            "relative_attention_num_buckets", "relative_attention_max_distance"
        )
        check_positive_int("max_position_embeddings", self.max_position_embeddings)
        if self.position_embedding == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"sinusoidal positions need an even d_model, got {self.d_model}")
        check_probability("dropout_rate", self.dropout_rate)
        check_real("layer_norm_epsilon", self.layer_norm_epsilon, gt=0.0)
        if self.attention_scale is not None:
            check_real("attention_scale", self.attention_scale, gt=0.0)
        self._check_token_ids("pad_token_id", "eos_token_id", "decoder_start_token_id")

    @classmethod
    def t5(cls, **overrides: Any) -> Seq2SeqConfig:
        """T5's components (relative bias, RMS norm, pre-LN, no biases, unscaled scores)."""
        return cls(**overrides)

    @classmethod
    def transformer(cls, **overrides: Any) -> Seq2SeqConfig:
        """The original Transformer (Vaswani et al., 2017): sinusoidal positions, post-LN,
        LayerNorm, ReLU feed-forward with biases, scaled embeddings, ``1/sqrt(d_k)`` scores."""
        base: dict[str, Any] = dict(
            position_embedding="sinusoidal",
            norm="layernorm",
            norm_position="post",
            layer_norm_epsilon=1e-5,
            mlp="standard",
            dense_act_fn="relu",
            bias=True,
            attention_scale=None,
            scale_embeddings=True,
            tie_word_embeddings=True,
            rescale_output=False,
        )
        return cls(**(base | overrides))
