"""The sequence mixers a decoder layer can hold, by name (``LayerSpec.mixer``).

:class:`~attnlab.models.decoder.DecoderLM` builds each layer's mixer through this one
mapping, so a new kind (Mamba, Mamba-2, RWKV, retention) is added by registering it
here, without a branch in the decoder. A mixer module is called like
:class:`~attnlab.modules.attention.MultiHeadAttention` inside
:class:`~attnlab.modules.decoder_layer.DecoderLayer`, ``mixer(h, plan, cache)`` with the
forward's :class:`~attnlab.backends.plan.AttentionPlan`, and returns ``(output
[B, L, D], weights or None)``; mixers that are not attention read what they need from
the plan (the new tokens' padding, ``token_mask``) and ignore the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from attnlab.backends.plan import AttentionPlan
from attnlab.cache.recurrent import MambaState, RecurrentState
from attnlab.cache.state_slots import StateSlots
from attnlab.models.flat import run_grouped
from attnlab.models.layout import MambaLayerConfig
from attnlab.modules.attention import MultiHeadAttention
from attnlab.modules.mamba import MambaMixer
from attnlab.modules.norms import PerHeadNorm, RMSNorm, make_norm

if TYPE_CHECKING:
    from attnlab.models.decoder_config import DecoderConfig

__all__ = [
    "Mixer",
    "MixerParts",
    "StateMixer",
    "build_mixer",
    "get_mixer",
    "mixer_names",
    "register_mixer",
]


@dataclass(frozen=True)
class MixerParts:
    """What the decoder shares with every layer's mixer.

    Attributes:
        layer_index: the layer's index in the stack.
        rotary: the layer's rotary embedding (shared by the layers of one RoPE base), or
            None (no RoPE, or a NoPE layer).
        backend: the attention backend name.
    """

    layer_index: int
    rotary: nn.Module | None = None
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


def _qk_norm(config: DecoderConfig, heads: int) -> nn.Module:
    """The QK-norm of ``heads`` heads: over the whole projection or per head."""
    assert config.head_dim is not None
    if config.qk_norm_scope == "head":
        norm = make_norm(config.norm, config.head_dim, config.norm_eps)
        return PerHeadNorm(norm=norm, head_dim=config.head_dim)
    return make_norm(config.norm, heads * config.head_dim, config.norm_eps)


def _attention(config: DecoderConfig, parts: MixerParts) -> nn.Module:
    assert config.head_dim is not None and config.num_key_value_heads is not None
    q_norm = k_norm = None
    if config.qk_norm:
        q_norm = _qk_norm(config, config.num_attention_heads)
        k_norm = _qk_norm(config, config.num_key_value_heads)
    scalar = config.query_pre_attn_scalar
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
        q_norm=q_norm,
        k_norm=k_norm,
        scale=None if scalar is None else scalar**-0.5,
    )


register_mixer(Mixer(name="attention", build=_attention))


class StateMixer(nn.Module):
    """A recurrent mixer (``mixer(x, mask=, state=)``) in an attention mixer's seat.

    The decoder layer calls every mixer as ``mixer(h, plan, cache)``; this one reads the
    plan's ``token_mask`` (``[B, L]``, 1 token, 0 padding: padded steps leave the state
    unchanged) and continues from ``cache`` (the layer's recurrent state). It returns no
    attention weights.

    Args:
        mixer: the recurrent mixer, e.g. :class:`~attnlab.modules.mamba.MambaMixer`.
    """

    def __init__(self, *, mixer: nn.Module) -> None:
        super().__init__()
        self.mixer = mixer

    def forward(self, x: Tensor, plan: AttentionPlan, cache: Any = None) -> tuple[Tensor, None]:
        """``x [B, L, D] -> ([B, L, D], None)``; continues from and updates ``cache``.

        Raises:
            TypeError: ``cache`` is not a recurrent state (e.g. a KV cache).
        """
        self._check_cache(cache)
        if plan.layout is not None:  # a flat serving step: states in slots, by group
            assert plan.state_slots is not None and plan.positions is not None
            assert isinstance(cache, StateSlots)
            mixer = self.mixer
            out = run_grouped(
                lambda xg, _pos, state: mixer(xg, mask=None, state=state),
                x,
                plan.layout,
                plan.positions,
                plan.state_slots,
                cache,
            )
            return out, None
        out = self.mixer(x, mask=plan.token_mask, state=cache)
        return out, None

    def _check_cache(self, cache: Any) -> None:
        """TypeError unless ``cache`` is None, a recurrent state or serving's state slots."""
        if cache is not None and not isinstance(cache, RecurrentState | StateSlots):
            raise TypeError(
                f"a {type(self.mixer).__name__} layer carries a recurrent state, got a "
                f"{type(cache).__name__}; build the cache with the model's new_cache()"
            )


def _mamba_settings(config: DecoderConfig, layer_index: int) -> MambaLayerConfig:
    spec = config.layer_specs[layer_index].mamba
    return spec if spec is not None else MambaLayerConfig()


def _mamba(config: DecoderConfig, parts: MixerParts) -> nn.Module:
    m = _mamba_settings(config, parts.layer_index)
    d = config.hidden_size
    rank = m.rank(d)
    norms: dict[str, nn.Module | None] = {"dt_norm": None, "b_norm": None, "c_norm": None}
    if m.inner_norms:
        norms = {
            "dt_norm": RMSNorm(rank, eps=config.norm_eps),
            "b_norm": RMSNorm(m.state_size, eps=config.norm_eps),
            "c_norm": RMSNorm(m.state_size, eps=config.norm_eps),
        }
    mixer = MambaMixer(
        hidden_size=d,
        intermediate_size=m.expand * d,
        state_size=m.state_size,
        conv_kernel=m.conv_kernel,
        dt_rank=rank,
        conv_bias=m.conv_bias,
        bias=m.proj_bias,
        chunk_size=m.chunk_size,
        **norms,
    )
    return StateMixer(mixer=mixer)


register_mixer(
    Mixer(name="mamba", build=_mamba, new_cache=lambda config, kind, max_length: MambaState())
)

# the linear-attention, gated-recurrence and retention mixers register themselves on import
from attnlab.models import linear_mixers as _linear_mixers  # noqa: E402, F401
from attnlab.models import recurrent_mixers as _recurrent_mixers  # noqa: E402, F401
