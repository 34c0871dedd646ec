"""Decoding loops: :func:`generate` and its streaming form :func:`stream`."""

from attnlab.generation.generate import generate, stream

__all__ = ["generate", "stream"]
