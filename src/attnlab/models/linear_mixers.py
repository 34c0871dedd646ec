"""The linear-attention and gated-recurrence mixers, registered for any decoder layout.

``LayerSpec(mixer=NAME, linear=LinearLayerConfig(...))`` with NAME one of:

* ``"delta_net"``: DeltaNet (Yang et al., 2024), :class:`~attnlab.modules.delta_net.GatedDeltaNet`
  without the decay;
* ``"gated_delta_net"``: Gated DeltaNet (Yang et al., 2025) in Qwen3-Next's layout;
* ``"gla"``: gated linear attention (Yang et al., 2024);
* ``"rglru"``: Griffin's recurrent block (De et al., 2024), RecurrentGemma's layout;
* ``"short_conv"``: LFM2's gated short convolution;
* ``"rwkv7"``: RWKV-7's time mix (Peng et al., 2025), with its cross-layer value residual
  (the first RWKV-7 layer's values handed to the later ones through the plan's ``carry``);
* ``"mamba2"``: the Mamba-2 mixer (Dao & Gu, 2024), for hybrids such as Bamba;
* ``"gated_attention"``: the decoder's attention with a sigmoid output gate (Qwen3-Next's
  full-attention layers; it uses the decoder's KV caches).

Each carries a fixed-size state from :mod:`attnlab.cache.linear_state` in the model's one
:class:`~attnlab.cache.base.ModelCache`, beside attention layers' KV caches in a hybrid.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from attnlab.backends.plan import AttentionPlan
from attnlab.cache.linear_state import (
    DeltaNetState,
    GLAState,
    RGLRUState,
    RWKV7State,
    ShortConvState,
)
from attnlab.cache.recurrent import Mamba2State, RecurrentState
from attnlab.cache.state_slots import StateSlots
from attnlab.models.flat import run_grouped
from attnlab.models.linear_layout import LinearLayerConfig
from attnlab.models.mixers import Mixer, MixerParts, StateMixer, _attention, register_mixer
from attnlab.modules.attention import MultiHeadAttention
from attnlab.modules.delta_net import GatedDeltaNet
from attnlab.modules.gated_attention import OutputGatedAttention
from attnlab.modules.gla import GatedLinearAttention
from attnlab.modules.mamba import Mamba2Mixer
from attnlab.modules.rglru import GatedShortConv, RecurrentBlock
from attnlab.modules.rwkv7 import RWKV7TimeMix

if TYPE_CHECKING:
    from attnlab.models.decoder_config import DecoderConfig

__all__ = ["PositionalStateMixer", "RWKV7Mixer"]


class PositionalStateMixer(StateMixer):
    """A :class:`StateMixer` that also hands the mixer the tokens' ``positions`` (RG-LRU's reset)."""

    def forward(self, x: Tensor, plan: AttentionPlan, cache: Any = None) -> tuple[Tensor, None]:
        if plan.layout is not None:  # a flat serving step: states in slots, by group
            assert plan.state_slots is not None and plan.positions is not None
            assert isinstance(cache, StateSlots)
            mixer = self.mixer
            out = run_grouped(
                lambda xg, pos, state: mixer(xg, mask=None, state=state, positions=pos),
                x,
                plan.layout,
                plan.positions,
                plan.state_slots,
                cache,
            )
            return out, None
        if cache is not None and not isinstance(cache, RecurrentState):
            raise TypeError(
                f"a {type(self.mixer).__name__} layer carries a recurrent state, got a "
                f"{type(cache).__name__}; build the cache with the model's new_cache()"
            )
        out = self.mixer(x, mask=plan.token_mask, state=cache, positions=plan.positions)
        return out, None


def _settings(config: DecoderConfig, parts: MixerParts) -> LinearLayerConfig:
    spec = config.layer_specs[parts.layer_index].linear
    return spec if spec is not None else LinearLayerConfig()


def _delta_net(decay: bool) -> Any:
    def build(config: DecoderConfig, parts: MixerParts) -> nn.Module:
        s = _settings(config, parts)
        assert config.head_dim is not None
        hk = s.num_heads or config.num_attention_heads
        dk = s.head_dim or config.head_dim
        return StateMixer(
            mixer=GatedDeltaNet(
                hidden_size=config.hidden_size,
                num_k_heads=hk,
                num_v_heads=s.num_value_heads or hk,
                head_k_dim=dk,
                head_v_dim=s.value_head_dim or dk,
                conv_kernel=s.conv_kernel,
                decay=decay,
                norm_eps=config.norm_eps,
                chunk_size=s.chunk_size,
            )
        )

    return build


def _gla(config: DecoderConfig, parts: MixerParts) -> nn.Module:
    s = _settings(config, parts)
    assert config.head_dim is not None
    h = s.num_heads or config.num_attention_heads
    dk = s.head_dim or max(1, config.head_dim // 2)
    dv = s.value_head_dim or config.head_dim
    return StateMixer(
        mixer=GatedLinearAttention(
            hidden_size=config.hidden_size,
            num_heads=h,
            key_dim=h * dk,
            value_dim=h * dv,
            norm_eps=config.norm_eps,
            chunk_size=s.chunk_size,
        )
    )


def _rglru(config: DecoderConfig, parts: MixerParts) -> nn.Module:
    s = _settings(config, parts)
    return PositionalStateMixer(
        mixer=RecurrentBlock(
            hidden_size=config.hidden_size,
            lru_width=s.width or config.hidden_size,
            num_blocks=s.num_heads or config.num_attention_heads,
            conv_kernel=s.conv_kernel,
            chunk_size=s.chunk_size,
        )
    )


def _short_conv(config: DecoderConfig, parts: MixerParts) -> nn.Module:
    s = _settings(config, parts)
    return StateMixer(
        mixer=GatedShortConv(
            hidden_size=config.hidden_size, conv_kernel=s.conv_kernel, bias=s.conv_bias
        )
    )


V_FIRST = "rwkv7.v_first"


class RWKV7Mixer(StateMixer):
    """RWKV-7's time mix with the cross-layer value residual: the first RWKV-7 layer puts
    its values in the plan's ``carry`` (one per forward), every later one mixes them in."""

    def forward(self, x: Tensor, plan: AttentionPlan, cache: Any = None) -> tuple[Tensor, None]:
        mixer = self.mixer
        assert isinstance(mixer, RWKV7TimeMix)
        role = mixer.value_residual
        if role == "none":
            return super().forward(x, plan, cache)
        if role == "mix" and V_FIRST not in plan.carry:
            raise ValueError(
                "an RWKV-7 layer that mixes in the first layer's values ran before that layer"
            )
        if plan.layout is None:
            if cache is not None and not isinstance(cache, RecurrentState):
                raise TypeError(
                    f"an RWKV7TimeMix layer carries a recurrent state, got a "
                    f"{type(cache).__name__}; build the cache with the model's new_cache()"
                )
            if role == "first":
                out, v = mixer(x, mask=plan.token_mask, state=cache, return_values=True)
                plan.carry[V_FIRST] = v
                return out, None
            return mixer(x, mask=plan.token_mask, state=cache, v_first=plan.carry[V_FIRST]), None
        # a flat serving step: run_grouped runs the groups in layout.state_groups' order
        assert plan.state_slots is not None and plan.positions is not None
        assert isinstance(cache, StateSlots)
        groups = iter(plan.layout.state_groups)
        flat = x.new_empty(x.shape) if role == "first" else plan.carry[V_FIRST]

        def run(xg: Tensor, _pos: Tensor, state: Any) -> Tensor:
            g = next(groups)
            if role == "first":
                y, v = mixer(xg, mask=None, state=state, return_values=True)
                flat[0].index_copy_(0, g.tokens, v.reshape(-1, v.shape[-1]))
                return y
            vg = flat[0].index_select(0, g.tokens).view(xg.shape)
            return mixer(xg, mask=None, state=state, v_first=vg)

        out = run_grouped(run, x, plan.layout, plan.positions, plan.state_slots, cache)
        if role == "first":
            plan.carry[V_FIRST] = flat
        return out, None


def _rwkv7(config: DecoderConfig, parts: MixerParts) -> nn.Module:
    s = _settings(config, parts)
    rwkv = [i for i, spec in enumerate(config.layer_specs) if spec.mixer == "rwkv7"]
    role = "none"
    if s.value_residual:
        role = "first" if parts.layer_index == rwkv[0] else "mix"
    return RWKV7Mixer(
        mixer=RWKV7TimeMix(
            hidden_size=config.hidden_size,
            num_heads=s.num_heads or config.num_attention_heads,
            chunk_size=s.chunk_size,
            value_residual=role,
        )
    )


def _mamba2(config: DecoderConfig, parts: MixerParts) -> nn.Module:
    s = _settings(config, parts)
    width = s.width or 2 * config.hidden_size
    p = s.head_dim or 64
    heads = s.num_heads or width // p
    if heads * p != width:
        raise ValueError(
            f"layers[{parts.layer_index}]: Mamba-2's width ({width}) must be num_heads ({heads}) "
            f"x head_dim ({p})"
        )
    return StateMixer(
        mixer=Mamba2Mixer(
            hidden_size=config.hidden_size,
            num_heads=heads,
            head_dim=p,
            state_size=s.state_size,
            n_groups=s.n_groups,
            conv_kernel=s.conv_kernel,
            conv_bias=s.conv_bias,
            bias=s.proj_bias,
            norm_eps=config.norm_eps,
            dt_limit=s.dt_limit if s.dt_limit is not None else (0.0, math.inf),
            chunk_size=s.chunk_size,
        )
    )


def _gated_attention(config: DecoderConfig, parts: MixerParts) -> nn.Module:
    inner = _attention(config, parts)
    assert isinstance(inner, MultiHeadAttention) and config.head_dim is not None
    width = config.num_attention_heads * config.head_dim
    return OutputGatedAttention(
        attention=inner, gate_proj=nn.Linear(config.hidden_size, width, bias=False)
    )


register_mixer(Mixer(name="gated_attention", build=_gated_attention))


def _state_factory(state: type[RecurrentState]) -> Callable[[DecoderConfig, str, int], Any]:
    def new_cache(config: DecoderConfig, kind: str, max_length: int) -> Any:
        return state()

    return new_cache


for _name, _build, _state in (
    ("delta_net", _delta_net(False), DeltaNetState),
    ("gated_delta_net", _delta_net(True), DeltaNetState),
    ("gla", _gla, GLAState),
    ("rglru", _rglru, RGLRUState),
    ("short_conv", _short_conv, ShortConvState),
    ("rwkv7", _rwkv7, RWKV7State),
    ("mamba2", _mamba2, Mamba2State),
):
    register_mixer(Mixer(name=_name, build=_build, new_cache=_state_factory(_state)))
