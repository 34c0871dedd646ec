"""Model configs: dataclasses validated on construction.

Field names follow Hugging Face's ``BertConfig`` so that a transformers user
reads them without a glossary.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnlab.functional._checks import (
    check_int,
    check_probability,
    check_real,
)
from attnlab.models._base import ConfigBase, check_kv_heads, check_model_type
from attnlab.modules.activations import activation_names

__all__ = ["POSITION_TYPES", "EncoderConfig"]

POSITION_TYPES = ("absolute", "roberta", "rope", "alibi")


@dataclass
class EncoderConfig(ConfigBase):
    """A BERT-style encoder.

    Attributes:
        vocab_size: number of token ids.
        hidden_size: model width ``D``.
        num_hidden_layers: number of encoder layers.
        num_attention_heads: query heads per layer.
        num_key_value_heads: key/value heads (GQA/MQA); default ``num_attention_heads``.
        intermediate_size: feed-forward inner width.
        hidden_act: feed-forward activation name.
        hidden_dropout_prob: dropout on embeddings and sublayer outputs.
        attention_probs_dropout_prob: dropout on attention weights.
        max_position_embeddings: learned positions (sequence length limit).
        type_vocab_size: token types (segments); 0 for none.
        layer_norm_eps: LayerNorm epsilon.
        pad_token_id: padding token id.
        norm_position: ``"post"`` (BERT) or ``"pre"`` (pre-LN, with a final norm).
        add_pooler: add BERT's pooler (dense + tanh over the first token).
        attention_window: Longformer's local attention (Beltagy et al., 2020): each token
            attends to ``attention_window // 2`` keys on either side plus the global tokens
            a forward names (``global_attention_mask``), with separate global projections.
            An even int for every layer, or one per layer; None (default) is full attention.
        position_embedding_type: ``"absolute"`` (BERT: learned, counted from 0),
            ``"roberta"`` (learned, counted from ``pad_token_id + 1``, padding tokens at
            ``pad_token_id``: RoBERTa, Longformer), ``"rope"`` (rotary, Su et al., 2021) or
            ``"alibi"`` (a symmetric linear bias ``-m_h |i - j|``, Press et al., 2022): the
            last two have no learned position table, and suit long encoders.
        rope_theta: RoPE's base.
        gradient_checkpointing: recompute each layer in the backward instead of keeping
            its activations (training only).
        norm_bias: biases in the LayerNorms (ModernBERT has none).
        attention_bias: biases on the attention projections.
        mlp: ``"standard"`` (two layers, BERT) or ``"gated"`` (GeGLU with ``hidden_act``:
            ModernBERT).
        mlp_bias: biases in the feed-forward.
        local_attention: per layer, a two-sided window of ``W`` keys (``W // 2`` on each
            side: ModernBERT's ``local_attention``) as a ``sliding_window`` pattern, or None
            for a global layer; None (default): every layer global.
        local_rope_theta: the RoPE base of the local layers (None: ``rope_theta``).
        first_attn_norm: False leaves the first layer's attention input unnormalised
            (ModernBERT: the embeddings' norm serves).
        model_type: the transformers ``model_type`` this config describes (``"roberta"``,
            ``"xlm-roberta"``, ``"distilbert"``...), which ``to_hf`` converts to when several
            share the same computation; None: inferred from the components.
    """

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int | None = None
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int | None = 0
    norm_position: str = "post"
    add_pooler: bool = True
    attention_window: int | tuple[int, ...] | None = None
    position_embedding_type: str = "absolute"
    rope_theta: float = 10000.0
    gradient_checkpointing: bool = False
    norm_bias: bool = True
    attention_bias: bool = True
    mlp: str = "standard"
    mlp_bias: bool = True
    local_attention: tuple[int | None, ...] | None = None
    local_rope_theta: float | None = None
    first_attn_norm: bool = True
    model_type: str | None = None

    def __post_init__(self) -> None:
        self._check_positive_ints(
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
        )
        check_kv_heads(self)
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.hidden_act not in activation_names():
            raise ValueError(f"hidden_act {self.hidden_act!r} unknown; known: {activation_names()}")
        check_probability("hidden_dropout_prob", self.hidden_dropout_prob)
        check_probability("attention_probs_dropout_prob", self.attention_probs_dropout_prob)
        check_int("type_vocab_size", self.type_vocab_size, min_value=0)
        check_real("layer_norm_eps", self.layer_norm_eps, gt=0.0)
        self._check_token_ids("pad_token_id")
        if self.norm_position not in ("pre", "post"):
            raise ValueError(f"norm_position must be 'pre' or 'post', got {self.norm_position!r}")
        if self.position_embedding_type not in POSITION_TYPES:
            raise ValueError(
                f"position_embedding_type must be one of {POSITION_TYPES}, got "
                f"{self.position_embedding_type!r}"
            )
        if self.position_embedding_type == "roberta" and self.pad_token_id is None:
            raise ValueError("position_embedding_type='roberta' needs a pad_token_id")
        if self.position_embedding_type == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head dim, got {self.head_dim}")
        check_real("rope_theta", self.rope_theta, gt=0.0)
        if self.mlp not in ("standard", "gated"):
            raise ValueError(f"mlp must be 'standard' or 'gated', got {self.mlp!r}")
        self._check_local_attention()
        check_model_type(self)
        if self.attention_window is not None:
            w = self.attention_window
            if isinstance(w, list):
                w = self.attention_window = tuple(w)
            windows = w if isinstance(w, tuple) else (w,)
            bad = [
                x
                for x in windows
                if isinstance(x, bool) or not isinstance(x, int) or x < 2 or x % 2
            ]
            if bad or not windows:
                raise ValueError(
                    f"attention_window must be an even int >= 2 or one per layer, got {w!r}"
                )
            if isinstance(w, tuple) and len(w) != self.num_hidden_layers:
                raise ValueError(
                    f"attention_window has {len(w)} entries for {self.num_hidden_layers} layers"
                )
            if self.num_key_value_heads != self.num_attention_heads:
                raise ValueError(
                    "Longformer attention (attention_window) has no grouped-query variant: "
                    f"num_key_value_heads={self.num_key_value_heads} != "
                    f"num_attention_heads={self.num_attention_heads}"
                )

    def _check_local_attention(self) -> None:
        w = self.local_attention
        if w is None:
            return
        if isinstance(w, list):
            w = self.local_attention = tuple(w)
        if not isinstance(w, tuple) or len(w) != self.num_hidden_layers:
            raise ValueError(
                f"local_attention must list one window (or None) per layer, "
                f"{self.num_hidden_layers} in all; got {w!r}"
            )
        for x in w:
            if x is not None and (isinstance(x, bool) or not isinstance(x, int) or x < 2):
                raise ValueError(f"local_attention windows must be ints >= 2 or None, got {w!r}")
        if self.attention_window is not None and any(x is not None for x in w):
            raise ValueError("local_attention and Longformer's attention_window do not combine")
        if self.local_rope_theta is not None:
            check_real("local_rope_theta", self.local_rope_theta, gt=0.0)

    def layer_window(self, layer: int) -> int | None:
        """Keys on each side that layer ``layer`` attends to, or None for full attention."""
        w = self.attention_window
        if w is None:
            return None
        return (w[layer] if isinstance(w, tuple) else w) // 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads
