"""Model configs: dataclasses validated on construction.

Field names follow Hugging Face's ``BertConfig`` so that a transformers user
reads them without a glossary.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnlab.functional._checks import (
    check_int,
    check_positive_int,
    check_probability,
    check_real,
)
from attnlab.models._base import ConfigBase
from attnlab.modules.activations import activation_names

__all__ = ["EncoderConfig"]


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
        gradient_checkpointing: recompute each layer in the backward instead of keeping
            its activations (training only).
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
    gradient_checkpointing: bool = False

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
        ):
            check_positive_int(name, getattr(self, name))
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        check_positive_int("num_key_value_heads", self.num_key_value_heads)
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})"
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

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads
