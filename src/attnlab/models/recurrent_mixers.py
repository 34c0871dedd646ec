"""RetNet's multi-scale retention as a decoder mixer (``LayerSpec(mixer="retention")``).

Retention (Sun et al., 2023, "Retentive Network") is a recurrent mixer that also needs
each token's position (its rotation, and the decay it starts from), so it reads the
plan's ``positions`` beside the new tokens' padding; its state is one
:class:`~attnlab.cache.recurrent.RetentionState` per layer. Its settings come from
``LayerSpec(linear=LinearLayerConfig(num_heads=, width=, chunk_size=))``: the heads
(default ``num_attention_heads``), the total value width (default ``2 D``) and the
chunk of the chunkwise form.

Shape notation: ``B`` batch, ``L`` new tokens, ``D`` width.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from attnlab.backends.plan import AttentionPlan
from attnlab.cache.recurrent import RetentionState
from attnlab.models.flat import run_grouped
from attnlab.models.linear_layout import LinearLayerConfig
from attnlab.models.mixers import Mixer, MixerParts, StateMixer, register_mixer
from attnlab.modules.retention import MultiScaleRetention

if TYPE_CHECKING:
    from attnlab.models.decoder_config import DecoderConfig

__all__ = ["PositionalStateMixer"]


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
