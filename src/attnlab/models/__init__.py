"""Configs and the models built from them."""

from attnlab.models.config import EncoderConfig
from attnlab.models.encoder import EncoderModel
from attnlab.models.outputs import EncoderOutput

__all__ = ["EncoderConfig", "EncoderModel", "EncoderOutput"]
