"""Per-layer attention settings of a decoder: RoPE modules by base, windows and score modifiers.

A decoder's layers may differ in their attention (``LayerSpec.sliding_window``,
``rope``, ``rope_theta``): Gemma 2 alternates local (windowed) and global layers, Gemma 3
has five local layers per global one with a RoPE base of their own, SmolLM3 leaves RoPE
out of every fourth layer. The model builds one RoPE module per distinct base (layers
share it, so its cos/sin are computed once per forward) and one mask pattern per
distinct window, with the config's score modifiers (soft-capping, ALiBi) attached.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from attnlab.backends.registry import Explanation
from attnlab.functional.masks import MaskPattern, causal, padding, sliding_window
from attnlab.functional.positions import RopeConvention
from attnlab.functional.score_mods import ScoreMod, alibi, softcap
from attnlab.models.decoder_config import DecoderConfig
from attnlab.modules.positions import RotaryEmbedding

__all__ = ["AttentionGroup", "layer_pattern", "layer_rotaries", "score_mods"]


class AttentionGroup(NamedTuple):
    """The layers that share one attention pattern in a forward, and how they run.

    Attributes:
        layers: their indices.
        window: their sliding window (None: global attention).
        pattern: the pattern they evaluate, as text.
        explanation: the registry's choice of backend for them, and why.
    """

    layers: tuple[int, ...]
    window: int | None
    pattern: str
    explanation: Explanation

    def __str__(self) -> str:
        where = f"window {self.window}" if self.window is not None else "global"
        return f"layers {list(self.layers)} ({where}): {self.pattern}\n{self.explanation}"


def layer_rotaries(config: DecoderConfig) -> list[RotaryEmbedding | None]:
    """Each layer's RoPE module (None: no RoPE), one instance per distinct base.

    Layers with ``rope_theta`` get an unscaled RoPE of that base; the others the config's
    base and scaling. ``partial_rotary_factor`` rotates the first ``rotary_dim`` features.
    """
    if config.position_embedding != "rope":
        return [None] * config.num_hidden_layers
    convention: RopeConvention = (
        "interleaved" if config.rope_convention == "interleaved" else "half"
    )
    made: dict[float | None, RotaryEmbedding] = {}

    def rotary(theta: float | None) -> RotaryEmbedding:
        if theta not in made:
            made[theta] = RotaryEmbedding(
                dim=config.rotary_dim,
                base=config.rope_theta if theta is None else theta,
                scaling=config.rope_scaling if theta is None else None,
                max_position_embeddings=config.max_position_embeddings,
                convention=convention,
            )
        return made[theta]

    from attnlab.models.mixers import get_mixer  # the registry; avoids an import cycle

    # attention mixers (those that use the decoder's KV caches) rotate; recurrent ones do not
    return [
        rotary(spec.rope_theta) if spec.rope and get_mixer(spec.mixer).new_cache is None else None
        for spec in config.layer_specs
    ]


def score_mods(config: DecoderConfig, slopes: Tensor | None) -> tuple[ScoreMod, ...]:
    """The score modifiers of every attention layer: ALiBi (``slopes``), then soft-capping.

    Gemma 2 caps the scaled scores (``c * tanh(s / c)``) before the mask; ALiBi and a cap
    do not meet in any checkpoint, and their order here is ALiBi first.
    """
    mods: list[ScoreMod] = []
    if slopes is not None:
        mods.append(alibi(slopes))
    if config.attn_logit_softcapping is not None:
        mods.append(softcap(config.attn_logit_softcapping))
    return tuple(mods)


def layer_pattern(
    window: int | None,
    mask: Tensor | None,
    extra: MaskPattern | None,
    mods: tuple[ScoreMod, ...],
) -> MaskPattern:
    """``causal() & sliding_window(W - 1) & padding(mask) & extra`` with ``mods`` attached."""
    pattern: MaskPattern = causal() if window is None else sliding_window(window - 1)
    if mask is not None:
        pattern = pattern & padding(mask)
    if extra is not None:
        pattern = pattern & extra
    return pattern.with_scores(*mods) if mods else pattern
