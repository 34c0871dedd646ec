"""Model outputs with the attribute names Hugging Face users know."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

__all__ = ["EncoderOutput"]


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
