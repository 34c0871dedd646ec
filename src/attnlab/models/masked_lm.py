"""An encoder with a masked-language-model head (BERT's pre-training objective).

Shape notation: ``B`` batch, ``S`` sequence, ``D`` width, ``V`` vocabulary.

The head is BERT's (Devlin et al., 2019, section 3.1): a dense layer, the activation
and a LayerNorm, then the output projection tied to the word embeddings plus a bias.
The loss counts the positions whose label is not ``-100`` (the masked ones).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnlab.functional.losses import token_loss
from attnlab.models.config import EncoderConfig
from attnlab.models.encoder import EncoderModel
from attnlab.models.outputs import MaskedLMOutput
from attnlab.modules.activations import get_activation
from attnlab.modules.linear import make_linear

__all__ = ["EncoderForMaskedLM", "MaskedLMHead"]


class MaskedLMHead(nn.Module):
    """``dense -> activation -> LayerNorm -> tied projection + bias``: ``[B, S, D] -> [B, S, V]``.

    Args:
        hidden_size: ``D``.
        vocab_size: ``V``.
        activation: activation name (BERT: ``"gelu"``).
        layer_norm_eps: LayerNorm epsilon.
    """

    def __init__(
        self, *, hidden_size: int, vocab_size: int, activation: str, layer_norm_eps: float
    ) -> None:
        super().__init__()
        self.dense = make_linear(hidden_size, hidden_size)
        self.act = get_activation(activation)
        self.norm = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(vocab_size))

    def forward(self, hidden: Tensor, output_weight: Tensor) -> Tensor:
        h = self.norm(self.act(self.dense(hidden)))  # [B, S, D]
        return nn.functional.linear(h, output_weight, self.bias)  # [B, S, V]


class EncoderForMaskedLM(nn.Module):
    """:class:`EncoderModel` (without pooler) plus :class:`MaskedLMHead`.

    Args:
        config: the encoder (``add_pooler`` is ignored: the head does not use it).
        backend: attention backend for every layer.
    """

    is_encoder_decoder = False

    def __init__(self, config: EncoderConfig, *, backend: str = "auto") -> None:
        super().__init__()
        if not isinstance(config, EncoderConfig):
            raise TypeError(f"config must be an EncoderConfig, got {type(config).__name__}")
        self.config = config
        self.encoder = EncoderModel(config, backend=backend)
        self.encoder.pooler = None
        self.head = MaskedLMHead(
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            activation=config.hidden_act,
            layer_norm_eps=config.layer_norm_eps,
        )

    def num_parameters(self) -> int:
        """Number of parameters (the tied projection counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        labels: Tensor | None = None,
    ) -> MaskedLMOutput:
        """Token scores at every position, and the masked-LM loss when ``labels`` are given.

        Args:
            input_ids: ``[B, S]`` token ids, some replaced by the mask token.
            attention_mask: ``[B, S]`` of 1 (token) / 0 (padding).
            token_type_ids: ``[B, S]`` segment ids.
            position_ids: ``[B, S]`` positions.
            inputs_embeds: ``[B, S, D]`` instead of ``input_ids``.
            output_attentions: return each layer's weights.
            output_hidden_states: return every layer's output.
            labels: ``[B, S]`` original ids at the masked positions, ``-100`` elsewhere.

        Returns:
            :class:`MaskedLMOutput`.
        """
        enc = self.encoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )
        logits = self.head(
            enc.last_hidden_state, self.encoder.embeddings.word_embeddings.weight
        )  # [B, S, V]
        return MaskedLMOutput(
            logits=logits,
            loss=token_loss(logits, labels) if labels is not None else None,
            hidden_states=enc.hidden_states,
            attentions=enc.attentions,
        )
