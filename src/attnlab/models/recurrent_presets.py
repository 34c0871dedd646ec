"""The recurrent language models as presets of the one decoder shell.

:func:`retnet_decoder_config` writes a :class:`~attnlab.models.recurrent_config.RetNetConfig`
as a :class:`~attnlab.models.decoder_config.DecoderConfig` of ``retention`` layers
(:mod:`attnlab.models.recurrent_mixers`) with gated feed-forwards, RMSNorms and no
position embedding, and :func:`retnet_as_decoder` moves a
:class:`~attnlab.models.recurrent.RetNetLM`'s weights into that
:class:`~attnlab.models.decoder.DecoderLM`: the same function of the same weights, which
then mixes with attention or any other registered mixer in one layout.
"""

from __future__ import annotations

from torch import Tensor

from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.layout import LayerSpec
from attnlab.models.linear_layout import LinearLayerConfig
from attnlab.models.recurrent import RetNetLM
from attnlab.models.recurrent_config import RetNetConfig

__all__ = ["retnet_as_decoder", "retnet_decoder_config", "retnet_decoder_keys"]

#: RetNetLM sub-module path -> DecoderLM sub-module path, within one layer. RetNet's GLU
#: ``fc2(act(fc1(x)) * gate(x))`` is the gated feed-forward ``down(act(gate(x)) * up(x))``.
_PARTS = {
    "retention_layer_norm": "self_attn_norm",
    "retention": "self_attention.mixer",
    "final_layer_norm": "ffn_norm",
    "ffn.fc1": "feed_forward.gate_proj",
    "ffn.gate": "feed_forward.up_proj",
    "ffn.fc2": "feed_forward.down_proj",
}


def retnet_decoder_config(config: RetNetConfig) -> DecoderConfig:
    """The :class:`DecoderConfig` that builds ``config``'s RetNet from ``retention`` layers.

    The multi-token form is the chunkwise one at ``config.chunk_size`` (the parallel form
    computes the same values; only its cost differs).

    Raises:
        TypeError: ``config`` is not a :class:`RetNetConfig`.
    """
    if not isinstance(config, RetNetConfig):
        raise TypeError(f"config must be a RetNetConfig, got {type(config).__name__}")
    assert config.value_dim is not None and config.intermediate_size is not None
    d, heads = config.hidden_size, config.num_heads
    retention = LinearLayerConfig(
        num_heads=heads, width=config.value_dim, chunk_size=config.chunk_size
    )
    return DecoderConfig(
        vocab_size=config.vocab_size,
        hidden_size=d,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=d // heads,
        intermediate_size=config.intermediate_size,
        hidden_act="gelu" if config.hidden_act == "gelu" else "silu",
        norm="rmsnorm",
        norm_eps=config.norm_eps,
        mlp="gated",
        position_embedding="none",
        embedding_scale=d**0.5 if config.scale_embedding else None,
        tie_word_embeddings=config.tie_word_embeddings,
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        layers=tuple(
            LayerSpec(mixer="retention", linear=retention) for _ in range(config.num_hidden_layers)
        ),
    )


def retnet_decoder_keys(key: str) -> str:
    """A :class:`RetNetLM` state-dict key as the preset :class:`DecoderLM`'s."""
    if key == "norm_f.weight":
        return "norm.weight"
    if not key.startswith("layers."):
        return key  # embed_tokens, lm_head
    i, rest = key[len("layers.") :].split(".", 1)
    for ours, theirs in _PARTS.items():
        if rest == ours or rest.startswith(ours + "."):
            return f"layers.{i}.{theirs}{rest[len(ours) :]}"
    raise ValueError(f"no DecoderLM key for RetNetLM key {key!r}")


def retnet_as_decoder(model: RetNetLM, *, backend: str = "auto") -> DecoderLM:
    """The :class:`DecoderLM` preset of ``model``, holding copies of its weights.

    Raises:
        TypeError: ``model`` is not a :class:`RetNetLM`.
    """
    if not isinstance(model, RetNetLM):
        raise TypeError(f"model must be a RetNetLM, got {type(model).__name__}")
    weight = model.embed_tokens.weight
    out = DecoderLM(retnet_decoder_config(model.config), backend=backend)
    out.to(dtype=weight.dtype, device=weight.device)
    state: dict[str, Tensor] = {retnet_decoder_keys(k): v for k, v in model.state_dict().items()}
    out.load_state_dict(state)
    return out.train(model.training)
