"""The sequence mixers a decoder layer can hold, by name (``LayerSpec.mixer``).

:class:`~attnlab.models.decoder.DecoderLM` builds each layer's mixer through this one
mapping, so a new kind (Mamba, Mamba-2, RWKV, retention) is added by registering it
here, without a branch in the decoder. A mixer module is called like
:class:`~attnlab.modules.attention.MultiHeadAttention` inside
:class:`~attnlab.modules.decoder_layer.DecoderLayer` (``mixer(h, attn_mask=...,
is_causal=..., positions=..., key_positions=..., cache=..., cache_start=...,
need_weights=...)``) and returns ``(output [B, L, D], weights or None)``; mixers that
are not attention ignore the attention-only keywords.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from attnlab.modules.attention import MultiHeadAttention
from attnlab.modules.norms import RMSNorm

if TYPE_CHECKING:
    from attnlab.models.decoder_config import DecoderConfig

__all__ = ["Mixer", "MixerParts", "build_mixer", "get_mixer", "mixer_names", "register_mixer"]


@dataclass(frozen=True)
class MixerParts:
    """What the decoder shares with every layer's mixer.

    Attributes:
        layer_index: the layer's index in the stack.
        rotary: the shared rotary embedding, or None.
        score_bias: the shared score bias (ALiBi), or None.
        backend: the attention backend name.
    """

    layer_index: int
    rotary: nn.Module | None = None
    score_bias: nn.Module | None = None
    backend: str = "auto"


@dataclass(frozen=True)
class Mixer:
    """A registered mixer kind.

    Attributes:
        name: its ``LayerSpec.mixer`` name.
        build: ``(config, parts) -> module``.
        new_cache: ``(config, kind, max_length) -> layer cache``, or None for a mixer that
            uses the decoder's KV caches (attention).
    """

    name: str
    build: Callable[[DecoderConfig, MixerParts], nn.Module]
    new_cache: Callable[[DecoderConfig, str, int], Any] | None = None


_MIXERS: dict[str, Mixer] = {}


def register_mixer(mixer: Mixer) -> Mixer:
    """Add (or replace) a mixer kind; returns it."""
    _MIXERS[mixer.name] = mixer
    return mixer


def mixer_names() -> list[str]:
    """The registered mixer names."""
    return sorted(_MIXERS)


def get_mixer(name: str) -> Mixer:
    """The mixer registered as ``name``; ValueError listing the known ones otherwise."""
    try:
        return _MIXERS[name]
    except KeyError:
        raise ValueError(f"unknown mixer {name!r}; registered: {mixer_names()}") from None


def build_mixer(name: str, config: DecoderConfig, parts: MixerParts) -> nn.Module:
    """Build the mixer ``name`` for one layer of ``config``."""
    return get_mixer(name).build(config, parts)


def _attention(config: DecoderConfig, parts: MixerParts) -> nn.Module:
    assert config.head_dim is not None and config.num_key_value_heads is not None
    q_norm = k_norm = None
    if config.qk_norm:
        q_norm = RMSNorm(config.num_attention_heads * config.head_dim, eps=config.norm_eps)
        k_norm = RMSNorm(config.num_key_value_heads * config.head_dim, eps=config.norm_eps)
    return MultiHeadAttention(
        embed_dim=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        bias=config.attention_bias,
        out_bias=config.attention_out_bias,
        dropout=config.attention_dropout,
        backend=parts.backend,
        rotary=parts.rotary,
        score_bias=parts.score_bias,
        q_norm=q_norm,
        k_norm=k_norm,
    )


register_mixer(Mixer(name="attention", build=_attention))
