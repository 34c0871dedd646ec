"""nn.Modules that own parameters and call :mod:`attnlab.functional` / :mod:`attnlab.backends`."""

from attnlab.modules.attention import MultiHeadAttention
from attnlab.modules.embeddings import Embeddings
from attnlab.modules.encoder_layer import EncoderLayer
from attnlab.modules.mlp import FeedForward

__all__ = ["Embeddings", "EncoderLayer", "FeedForward", "MultiHeadAttention"]
