"""nn.Modules that own parameters and call :mod:`attnlab.functional` / :mod:`attnlab.backends`."""

from attnlab.modules.attention import MultiHeadAttention
from attnlab.modules.decoder_layer import DecoderLayer
from attnlab.modules.embeddings import Embeddings
from attnlab.modules.encoder_layer import EncoderLayer
from attnlab.modules.mlp import FeedForward, GatedFeedForward
from attnlab.modules.norms import RMSNorm
from attnlab.modules.positions import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEmbedding,
    T5RelativePositionBias,
)

__all__ = [
    "DecoderLayer",
    "Embeddings",
    "EncoderLayer",
    "FeedForward",
    "GatedFeedForward",
    "LearnedPositionalEmbedding",
    "MultiHeadAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "SinusoidalPositionalEmbedding",
    "T5RelativePositionBias",
]
