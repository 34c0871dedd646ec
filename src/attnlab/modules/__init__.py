"""nn.Modules that own parameters and call :mod:`attnlab.functional` / :mod:`attnlab.backends`."""

from attnlab.modules.attention import MultiHeadAttention
from attnlab.modules.decoder_layer import DecoderLayer
from attnlab.modules.embeddings import Embeddings
from attnlab.modules.encoder_layer import EncoderLayer
from attnlab.modules.mlp import FeedForward, GatedFeedForward
from attnlab.modules.norms import RMSNorm
from attnlab.modules.position import LearnedPositionalEmbedding, SinusoidalPositionalEmbedding
from attnlab.modules.rotary import RotaryEmbedding
from attnlab.modules.score_bias import ALiBi, T5RelativePositionBias

__all__ = [
    "ALiBi",
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
