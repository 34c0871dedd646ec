"""Configs and the models built from them."""

from attnlab.models.config import EncoderConfig
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.encoder import EncoderModel
from attnlab.models.masked_lm import EncoderForMaskedLM
from attnlab.models.outputs import (
    CausalLMOutput,
    EncoderOutput,
    MaskedLMOutput,
    Seq2SeqLMOutput,
)
from attnlab.models.seq2seq import Seq2SeqLM
from attnlab.models.seq2seq_config import Seq2SeqConfig

__all__ = [
    "CausalLMOutput",
    "DecoderConfig",
    "DecoderLM",
    "EncoderConfig",
    "EncoderForMaskedLM",
    "EncoderModel",
    "EncoderOutput",
    "MaskedLMOutput",
    "Seq2SeqConfig",
    "Seq2SeqLM",
    "Seq2SeqLMOutput",
]
