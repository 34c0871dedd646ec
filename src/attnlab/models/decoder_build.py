"""Builders of a decoder's layers from :class:`DecoderConfig`: the mixer (from the
registry of :mod:`attnlab.models.mixers`), the feed-forward (dense, gated or a mixture of
experts) and the norms around them, as one :class:`~attnlab.modules.decoder_layer.DecoderLayer`.
"""

from __future__ import annotations

from torch import nn

from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.layout import LayerSpec, MoEConfig
from attnlab.models.mixers import MixerParts, build_mixer
from attnlab.models.recurrent_mixers import rwkv_channel_mix
from attnlab.modules.decoder_layer import DecoderLayer
from attnlab.modules.experts import Experts, Router
from attnlab.modules.linear import make_linear
from attnlab.modules.mlp import FeedForward, GatedFeedForward
from attnlab.modules.moe import MoEBlock
from attnlab.modules.norms import make_norm

__all__ = ["build_decoder_layer", "build_feed_forward", "build_moe"]


def build_feed_forward(
    config: DecoderConfig, spec: LayerSpec, *, layer_index: int = 0
) -> nn.Module | None:
    """The feed-forward ``spec`` names: dense (the config's ``mlp``), MoE, RWKV's channel
    mix (initialised for layer ``layer_index``), or None."""
    d = config.hidden_size
    if spec.ffn == "none":
        return None
    if spec.ffn == "rwkv":
        return rwkv_channel_mix(config, layer_index)
    if spec.ffn == "moe":
        assert spec.moe is not None
        return build_moe(spec.moe, d, bias=config.mlp_bias)
    if config.mlp == "gated":
        return GatedFeedForward(
            embed_dim=d,
            hidden_dim=config.intermediate_size,
            activation=config.hidden_act,
            bias=config.mlp_bias,
        )
    return FeedForward(
        embed_dim=d,
        hidden_dim=config.intermediate_size,
        activation=config.hidden_act,
        bias=config.mlp_bias,
    )


def build_moe(moe: MoEConfig, embed_dim: int, *, bias: bool = False) -> MoEBlock:
    """A :class:`MoEBlock` as ``moe`` describes it (the shared expert is a gated or plain
    feed-forward like the routed ones)."""
    shared: nn.Module | None = None
    if moe.shared_expert_intermediate_size:
        kind = GatedFeedForward if moe.expert_mlp == "gated" else FeedForward
        shared = kind(
            embed_dim=embed_dim,
            hidden_dim=moe.shared_expert_intermediate_size,
            activation=moe.hidden_act,
            bias=bias,
        )
    return MoEBlock(
        router=Router(
            embed_dim=embed_dim,
            num_experts=moe.num_experts,
            top_k=moe.top_k,
            router=moe.router,
            normalize=moe.norm_topk_prob,
            capacity_factor=moe.capacity_factor,
            jitter=moe.router_jitter,
            noise_std=moe.router_noise_std,
        ),
        experts=Experts(
            num_experts=moe.num_experts,
            embed_dim=embed_dim,
            hidden_dim=moe.intermediate_size,
            activation=moe.hidden_act,
            gated=moe.expert_mlp == "gated",
        ),
        shared_expert=shared,
        shared_expert_gate=make_linear(embed_dim, 1, bias=False)
        if moe.shared_expert_gate
        else None,
        dispatch=moe.dispatch,
        capacity_factor=moe.capacity_factor,
    )


def build_decoder_layer(
    config: DecoderConfig,
    *,
    layer_index: int = 0,
    rotary: nn.Module | None = None,
    backend: str = "auto",
) -> DecoderLayer:
    """Decoder layer ``layer_index`` as ``config.layer_specs`` describes it (its mixer from
    :mod:`attnlab.models.mixers`, its feed-forward), with the shared position components."""
    d = config.hidden_size
    spec = config.layer_specs[layer_index]
    mixer = build_mixer(
        spec.mixer,
        config,
        MixerParts(layer_index=layer_index, rotary=rotary, backend=backend),
    )
    ff = build_feed_forward(config, spec, layer_index=layer_index)
    sandwich = config.norm_placement == "sandwich"

    def norm() -> nn.Module:
        return make_norm(config.norm, d, config.norm_eps)

    return DecoderLayer(
        self_attention=mixer,
        feed_forward=ff,
        self_attn_norm=norm(),
        ffn_norm=norm() if ff is not None else None,
        norm_position="pre",
        dropout=config.hidden_dropout,
        post_attn_norm=norm() if sandwich else None,
        post_ffn_norm=norm() if sandwich and ff is not None else None,
    )
