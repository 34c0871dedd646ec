"""Model outputs with the attribute names Hugging Face users know."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

__all__ = ["CausalLMOutput", "EncoderOutput", "MaskedLMOutput", "Seq2SeqLMOutput"]


@dataclass
class EncoderOutput:
    """Output of an encoder model.

    Attributes:
        last_hidden_state: ``[B, S, D]``.
        pooler_output: ``[B, D]`` when the model has a pooler.
        hidden_states: embeddings output and every layer's output, when asked for.
        attentions: one ``[B, H, S, S]`` tensor per layer, when ``output_attentions=True``.
    """

    last_hidden_state: Tensor
    pooler_output: Tensor | None = None
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None


@dataclass
class CausalLMOutput:
    """Output of a decoder-only language model.

    Attributes:
        logits: ``[B, L, V]`` next-token scores for each new token (None when the loss
            was computed without them: ``return_logits=False``).
        past_key_values: the :class:`~attnlab.cache.ModelCache` when ``use_cache=True``.
        hidden_states: embeddings output and every layer's output, when asked for.
        attentions: one ``[B, H, L, S]`` tensor per layer, when ``output_attentions=True``.
        loss: the mean next-token cross-entropy, when ``labels`` are given.
        router_logits: one ``[B * L, E]`` tensor per MoE layer, when
            ``output_router_logits=True``.
        aux_loss: the load-balancing loss over ``router_logits`` (unscaled, as
            transformers returns it), when ``output_router_logits=True``.
    """

    logits: Tensor | None
    past_key_values: Any = None
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None
    loss: Tensor | None = None
    router_logits: tuple[Tensor, ...] | None = None
    aux_loss: Tensor | None = None


@dataclass
class Seq2SeqLMOutput:
    """Output of an encoder-decoder language model.

    Attributes:
        logits: ``[B, L, V]`` for the decoder tokens.
        past_key_values: the decoder's :class:`~attnlab.cache.ModelCache`, when caching.
        encoder_last_hidden_state: ``[B, S_enc, D]``.
        decoder_attentions: decoder self-attention weights per layer, when asked for.
        cross_attentions: decoder cross-attention weights per layer, when asked for.
        encoder_attentions: encoder weights per layer, when asked for.
        loss: the mean cross-entropy of the logits against ``labels``, when given.
    """

    logits: Tensor
    past_key_values: Any = None
    encoder_last_hidden_state: Tensor | None = None
    decoder_attentions: tuple[Tensor, ...] | None = None
    cross_attentions: tuple[Tensor, ...] | None = None
    encoder_attentions: tuple[Tensor, ...] | None = None
    loss: Tensor | None = None


@dataclass
class MaskedLMOutput:
    """Output of an encoder with a masked-language-model head.

    Attributes:
        logits: ``[B, S, V]`` token scores at every position.
        loss: the mean cross-entropy over the positions whose label is not ``-100``.
        hidden_states: embeddings output and every layer's output, when asked for.
        attentions: one ``[B, H, S, S]`` tensor per layer, when asked for.
    """

    logits: Tensor
    loss: Tensor | None = None
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None
