r"""The recurrent language models as presets of the one decoder shell: their configs as
:class:`~attnlab.models.decoder_config.DecoderConfig`\ s, and their checkpoint names.

* :func:`mamba_decoder_config` writes a :class:`~attnlab.models.recurrent_config.MambaConfig`
  as ``mamba`` (version 1) or ``mamba2`` (version 2) layers without feed-forwards;
* :func:`rwkv_decoder_config` writes RWKV-4 (``mixer="rwkv"``, ``ffn="rwkv"``,
  LayerNorms, the embedding norm as its ``pre_ln``);
* :func:`retnet_decoder_config` writes a :class:`~attnlab.models.recurrent_config.RetNetConfig`
  as ``retention`` layers (:mod:`attnlab.models.recurrent_mixers`) with gated
  feed-forwards, RMSNorms and no position embedding.

:class:`~attnlab.models.recurrent.MambaLM`, ``RWKVLM`` and ``RetNetLM`` are
:class:`~attnlab.models.decoder.DecoderLM`\ s of these configs whose state dicts keep
the checkpoint names (:data:`MAMBA_PARTS`... map them; :func:`checkpoint_key` and
:func:`shell_key` rename). :func:`as_decoder` copies one into a plain ``DecoderLM``: the
same function of the same weights, which then mixes with attention or any other
registered mixer in one layout.
"""

from __future__ import annotations

import math
from typing import Any

from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.layout import LayerSpec, MambaLayerConfig
from attnlab.models.linear_layout import LinearLayerConfig
from attnlab.models.recurrent_config import MambaConfig, RetNetConfig, RWKVConfig

__all__ = [
    "MAMBA_PARTS",
    "RETNET_PARTS",
    "RWKV_PARTS",
    "as_decoder",
    "checkpoint_key",
    "mamba_decoder_config",
    "retnet_decoder_config",
    "rwkv_decoder_config",
    "shell_key",
]

#: MambaLM checkpoint path -> DecoderLM sub-module path, within one layer.
MAMBA_PARTS = {"norm": "self_attn_norm", "mixer": "self_attention.mixer"}

#: RWKVLM checkpoint path -> DecoderLM sub-module path, within one layer.
RWKV_PARTS = {
    "ln1": "self_attn_norm",
    "attention": "self_attention.mixer",
    "ln2": "ffn_norm",
    "feed_forward": "feed_forward.mixer",
}

#: RetNetLM checkpoint path -> DecoderLM sub-module path, within one layer. RetNet's GLU
#: ``fc2(act(fc1(x)) * gate(x))`` is the gated feed-forward ``down(act(gate(x)) * up(x))``.
RETNET_PARTS = {
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


#: Checkpoint name -> shell name of the parts outside the layers (the final norm, RWKV's
#: LayerNorm of the embeddings); the embeddings and the LM head keep theirs.
_OUTER = {"norm_f.": "norm.", "pre_ln.": "embed_norm."}


def shell_key(key: str, parts: dict[str, str]) -> str | None:
    """A checkpoint name as the shell's (:class:`DecoderLM`'s) name, or None when ``key``
    is no checkpoint name of a model with these ``parts``."""
    for ours, theirs in _OUTER.items():
        if key.startswith(ours):
            return theirs + key[len(ours) :]
    if not key.startswith("layers."):
        return key if key.startswith(("embed_tokens.", "lm_head.")) else None
    i, _, rest = key[len("layers.") :].partition(".")
    for ours, theirs in parts.items():
        if rest == ours or rest.startswith(ours + "."):
            return f"layers.{i}.{theirs}{rest[len(ours) :]}"
    return None


def checkpoint_key(key: str, parts: dict[str, str]) -> str:
    """The shell's name of a weight as its checkpoint name (:func:`shell_key` inverted).

    Raises:
        ValueError: ``key`` is no weight of a model with these ``parts``.
    """
    for ours, theirs in _OUTER.items():
        if key.startswith(theirs):
            return ours + key[len(theirs) :]
    if not key.startswith("layers."):
        return key
    i, _, rest = key[len("layers.") :].partition(".")
    for ours, theirs in parts.items():
        if rest == theirs or rest.startswith(theirs + "."):
            return f"layers.{i}.{ours}{rest[len(theirs) :]}"
    raise ValueError(f"no checkpoint name for the weight {key!r}")


def mamba_decoder_config(config: MambaConfig) -> DecoderConfig:
    """The :class:`DecoderConfig` that builds ``config``'s Mamba or Mamba-2 from mixers.

    Raises:
        TypeError: ``config`` is not a :class:`MambaConfig`.
    """
    if not isinstance(config, MambaConfig):
        raise TypeError(f"config must be a MambaConfig, got {type(config).__name__}")
    d = config.hidden_size
    width = config.expand * d
    if config.version == 2:
        assert config.num_heads is not None
        limit = None if tuple(config.dt_limit) == (0.0, math.inf) else config.dt_limit
        spec = LayerSpec(
            mixer="mamba2",
            ffn="none",
            linear=LinearLayerConfig(
                width=width,
                num_heads=config.num_heads,
                head_dim=config.head_dim,
                state_size=config.state_size,
                n_groups=config.n_groups,
                conv_kernel=config.conv_kernel,
                conv_bias=config.use_conv_bias,
                proj_bias=config.use_bias,
                dt_limit=limit,
                chunk_size=config.chunk_size,
            ),
        )
    else:
        spec = LayerSpec(
            mixer="mamba",
            ffn="none",
            mamba=MambaLayerConfig(
                state_size=config.state_size,
                conv_kernel=config.conv_kernel,
                expand=config.expand,
                dt_rank=config.dt_rank,
                conv_bias=config.use_conv_bias,
                proj_bias=config.use_bias,
                chunk_size=config.chunk_size,
            ),
        )
    return DecoderConfig(
        vocab_size=config.vocab_size,
        hidden_size=d,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=1,  # no attention layer: the fields are unused
        head_dim=d,
        intermediate_size=width,
        norm="rmsnorm",
        norm_eps=config.norm_eps,
        position_embedding="none",
        tie_word_embeddings=config.tie_word_embeddings,
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        layers=(spec,) * config.num_hidden_layers,
    )


def rwkv_decoder_config(config: RWKVConfig) -> DecoderConfig:
    """The :class:`DecoderConfig` that builds ``config``'s RWKV-4 from its parts.

    Raises:
        TypeError: ``config`` is not an :class:`RWKVConfig`.
    """
    if not isinstance(config, RWKVConfig):
        raise TypeError(f"config must be an RWKVConfig, got {type(config).__name__}")
    assert config.intermediate_size is not None
    d = config.hidden_size
    wkv = LinearLayerConfig(width=config.attention_hidden_size, chunk_size=config.chunk_size)
    return DecoderConfig(
        vocab_size=config.vocab_size,
        hidden_size=d,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=1,  # no attention layer: the fields are unused
        head_dim=d,
        intermediate_size=config.intermediate_size,
        norm="layernorm",
        norm_eps=config.layer_norm_epsilon,
        embedding_norm=True,
        position_embedding="none",
        tie_word_embeddings=config.tie_word_embeddings,
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        layers=(LayerSpec(mixer="rwkv", ffn="rwkv", linear=wkv),) * config.num_hidden_layers,
    )


def as_decoder(model: Any, *, backend: str = "auto") -> DecoderLM:
    """A plain :class:`DecoderLM` holding copies of a recurrent model's weights (the same
    function of the same weights; eval or train mode as ``model``), free to be mixed
    with other layers or converted like any decoder.

    Raises:
        TypeError: ``model`` is not a :class:`MambaLM`, :class:`RWKVLM` or :class:`RetNetLM`.
    """
    parts = getattr(type(model), "checkpoint_parts", None)
    if not isinstance(model, DecoderLM) or parts is None:
        raise TypeError(f"model must be a MambaLM, RWKVLM or RetNetLM, got {type(model).__name__}")
    weight = model.embed_tokens.weight
    out = DecoderLM(model.decoder_config, backend=backend)
    out.to(dtype=weight.dtype, device=weight.device)
    state = {shell_key(k, parts) or k: v for k, v in model.state_dict().items()}
    out.load_state_dict(state)
    return out.train(model.training)
