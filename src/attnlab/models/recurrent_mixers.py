"""RetNet's retention and RWKV-4 as decoder parts: ``LayerSpec(mixer="retention")``,
``LayerSpec(mixer="rwkv", ffn="rwkv")``.

Retention (Sun et al., 2023, "Retentive Network") is a recurrent mixer that also needs
each token's position (its rotation, and the decay it starts from), so it reads the
plan's ``positions`` beside the new tokens' padding; its state is one
:class:`~attnlab.cache.recurrent.RetentionState` per layer. Its settings come from
``LayerSpec(linear=LinearLayerConfig(num_heads=, width=, chunk_size=))``: the heads
(default ``num_attention_heads``), the total value width (default ``2 D``) and the
chunk of the chunkwise form.

RWKV-4 (Peng et al., 2023) is a time mix (the WKV recurrence, ``mixer="rwkv"``, its WKV
width from ``linear=LinearLayerConfig(width=)``, default ``D``) and a channel mix
(``ffn="rwkv"``, ``intermediate_size`` wide) that share one
:class:`~attnlab.cache.recurrent.RWKVState` per layer: each keeps its previous token there
(its token shift), so the channel mix is a feed-forward that reads the state
(:class:`StateFeedForward`).

Shape notation: ``B`` batch, ``L`` new tokens, ``D`` width.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from attnlab.backends.plan import AttentionPlan
from attnlab.cache.recurrent import RetentionState, RWKVState
from attnlab.models.flat import run_grouped
from attnlab.models.linear_layout import LinearLayerConfig
from attnlab.models.mixers import Mixer, MixerParts, StateMixer, register_mixer
from attnlab.modules.retention import MultiScaleRetention
from attnlab.modules.rwkv import RWKVChannelMix, RWKVTimeMix

if TYPE_CHECKING:
    from attnlab.models.decoder_config import DecoderConfig

__all__ = ["PositionalStateMixer", "StateFeedForward", "rwkv_channel_mix"]


class PositionalStateMixer(StateMixer):
    """A recurrent mixer that takes positions too (``mixer(x, positions=, mask=, state=)``).

    As :class:`~attnlab.models.mixers.StateMixer`, with the plan's ``positions``
    (``[B|1, L]``; in a flat serving step, each group's own) passed to the mixer.
    """

    def forward(self, x: Tensor, plan: AttentionPlan, cache: Any = None) -> tuple[Tensor, None]:
        """``x [B, L, D] -> ([B, L, D], None)``; continues from and updates ``cache``."""
        self._check_cache(cache)
        mixer = self.mixer
        if plan.layout is not None:  # a flat serving step: states in slots, by group
            assert plan.state_slots is not None and plan.positions is not None
            out = run_grouped(
                lambda xg, pos, state: mixer(xg, positions=pos, mask=None, state=state),
                x,
                plan.layout,
                plan.positions,
                plan.state_slots,
                cache,
            )
            return out, None
        assert plan.positions is not None
        return mixer(x, positions=plan.positions, mask=plan.token_mask, state=cache), None


def _retention(config: DecoderConfig, parts: MixerParts) -> PositionalStateMixer:
    s = config.layer_specs[parts.layer_index].linear or LinearLayerConfig()
    d = config.hidden_size
    return PositionalStateMixer(
        mixer=MultiScaleRetention(
            embed_dim=d,
            value_dim=s.width or 2 * d,
            num_heads=s.num_heads or config.num_attention_heads,
            norm_eps=config.norm_eps,
            chunk_size=s.chunk_size,
        )
    )


register_mixer(
    Mixer(
        name="retention",
        build=_retention,
        new_cache=lambda config, kind, max_length: RetentionState(),
    )
)


class StateFeedForward(StateMixer):
    """A feed-forward that carries a state (``ffn(x, mask=, state=)``), in a layer's
    feed-forward seat: called as ``ffn(h, plan, cache)`` (``reads_state``) and returning
    the output alone."""

    reads_state = True

    def forward(self, x: Tensor, plan: AttentionPlan, cache: Any = None) -> Tensor:  # type: ignore[override]
        """``x [B, L, D] -> [B, L, D]``; continues from and updates ``cache``."""
        out, _ = super().forward(x, plan, cache)
        return out


def rwkv_channel_mix(config: DecoderConfig, layer_index: int) -> StateFeedForward:
    """RWKV-4's channel mix for layer ``layer_index`` of ``config`` (``ffn="rwkv"``)."""
    return StateFeedForward(
        mixer=RWKVChannelMix(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            layer_id=layer_index,
            num_layers=config.num_hidden_layers,
        )
    )


def _rwkv(config: DecoderConfig, parts: MixerParts) -> StateMixer:
    s = config.layer_specs[parts.layer_index].linear or LinearLayerConfig()
    return StateMixer(
        mixer=RWKVTimeMix(
            hidden_size=config.hidden_size,
            attention_size=s.width or config.hidden_size,
            chunk_size=s.chunk_size,
            layer_id=parts.layer_index,
            num_layers=config.num_hidden_layers,
        )
    )


register_mixer(
    Mixer(name="rwkv", build=_rwkv, new_cache=lambda config, kind, max_length: RWKVState())
)
