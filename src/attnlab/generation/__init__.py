"""Decoding loops: :func:`generate` and its streaming form :func:`stream`; :func:`sink_cache`
for decoding past the context with attention sinks."""

from attnlab.generation.generate import generate, stream
from attnlab.generation.streaming import sink_cache

__all__ = ["generate", "sink_cache", "stream"]
