"""Mamba (``"mamba"``), Mamba-2 (``"mamba2"``) and RWKV-4 (``"rwkv"``) <-> attnlab.

The attnlab modules use transformers' parameter names inside each block, so the key maps
only rename the stacks: ``backbone.layers.{i}`` / ``rwkv.blocks.{i}`` -> ``layers.{i}``.
transformers' RWKV rescales some weights by powers of two at inference
(``rescale_every``); the conversion to transformers sets ``rescale_every=0`` and reads
checkpoints as stored (the rescaling leaves the logits equal up to LayerNorm's epsilon).
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor, nn

from attnlab.interop.hf import Converter, register_converter, require_transformers
from attnlab.interop.hybrid import special_tokens
from attnlab.models.recurrent import RWKVLM, MambaLM
from attnlab.models.recurrent_config import MambaConfig, RWKVConfig

__all__ = ["MAMBA", "MAMBA2", "RWKV"]


def _stack_map(model: nn.Module, theirs: dict[str, str]) -> dict[str, str]:
    """Every key of ``model``: the first matching prefix of ``theirs`` renamed."""
    out = {}
    for key in model.state_dict():
        for ours, prefix in theirs.items():
            if key.startswith(ours):
                out[key] = prefix + key[len(ours) :]
                break
        else:  # pragma: no cover - every key has a prefix above
            raise AssertionError(f"no mapping for {key}")
    return out


def _drop_tied(weights: dict[str, Tensor], tied: bool, head: str) -> dict[str, Tensor]:
    return {k: v for k, v in weights.items() if not (tied and k == head)}


# ---------------------------------------------------------------------- Mamba / Mamba-2


def mamba_config_from_hf(cfg: dict[str, Any], weight_names: set[str]) -> MambaConfig:
    version = 2 if cfg.get("model_type") == "mamba2" else 1
    h = cfg["hidden_size"]
    rank = cfg.get("time_step_rank", "auto")
    limit = cfg.get("time_step_limit") or (0.0, math.inf)
    common: dict[str, Any] = dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=h,
        num_hidden_layers=cfg["num_hidden_layers"],
        version=version,
        state_size=cfg["state_size"],
        expand=cfg.get("expand", 2),
        conv_kernel=cfg.get("conv_kernel", 4),
        use_conv_bias=bool(cfg.get("use_conv_bias", True)),
        use_bias=bool(cfg.get("use_bias", False)),
        norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", version == 1)),
        **special_tokens(cfg),
    )
    if version == 1:
        return MambaConfig(dt_rank=math.ceil(h / 16) if rank == "auto" else int(rank), **common)
    return MambaConfig(
        num_heads=cfg["num_heads"],
        head_dim=cfg["head_dim"],
        n_groups=cfg.get("n_groups", 1),
        dt_limit=(float(limit[0]), float(limit[1])),
        chunk_size=min(64, cfg.get("chunk_size", 64)),
        **common,
    )


def mamba_key_map(model: nn.Module) -> dict[str, str]:
    return _stack_map(
        model,
        {
            "embed_tokens.": "backbone.embeddings.",
            "layers.": "backbone.layers.",
            "norm_f.": "backbone.norm_f.",
            "lm_head.": "lm_head.",
        },
    )


def _mamba_from_hf(weights: dict[str, Tensor], config: MambaConfig) -> dict[str, Tensor]:
    return _drop_tied(weights, config.tie_word_embeddings, "lm_head.weight")


def mamba_to_hf(model: nn.Module) -> nn.Module:
    assert isinstance(model, MambaLM)
    c = model.config
    tf = require_transformers()
    common = dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_hidden_layers,
        state_size=c.state_size,
        expand=c.expand,
        conv_kernel=c.conv_kernel,
        use_bias=c.use_bias,
        use_conv_bias=c.use_conv_bias,
        layer_norm_epsilon=c.norm_eps,
        tie_word_embeddings=c.tie_word_embeddings,
        pad_token_id=c.pad_token_id,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
    )
    if c.version == 1:
        return tf.MambaForCausalLM(tf.MambaConfig(time_step_rank=c.dt_rank, **common))
    if c.intermediate_size != c.expand * c.hidden_size:
        raise ValueError(
            f"transformers' Mamba2 needs num_heads * head_dim ({c.intermediate_size}) = expand * "
            f"hidden_size ({c.expand * c.hidden_size})"
        )
    cfg = tf.Mamba2Config(
        num_heads=c.num_heads,
        head_dim=c.head_dim,
        n_groups=c.n_groups,
        time_step_limit=c.dt_limit,
        chunk_size=c.chunk_size,
        **common,
    )
    return tf.Mamba2ForCausalLM(cfg)


def _add_tied_head(weights: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    assert isinstance(model, MambaLM | RWKVLM)
    if model.lm_head is None:
        weights = dict(weights)
        head = "lm_head.weight" if isinstance(model, MambaLM) else "head.weight"
        weights[head] = model.embed_tokens.weight.detach()
    return weights


MAMBA = register_converter(
    Converter(
        model_type="mamba",
        hf_classes={"MambaForCausalLM": ""},
        attnlab_class=MambaLM,
        config_from_hf=mamba_config_from_hf,
        build=MambaLM,
        key_map=mamba_key_map,
        to_hf_model=mamba_to_hf,
        weights_from_hf=_mamba_from_hf,
        weights_to_hf=_add_tied_head,
        accepts=lambda m: isinstance(m, MambaLM) and m.config.version == 1,
    )
)

MAMBA2 = register_converter(
    Converter(
        model_type="mamba2",
        hf_classes={"Mamba2ForCausalLM": ""},
        attnlab_class=MambaLM,
        config_from_hf=mamba_config_from_hf,
        build=MambaLM,
        key_map=mamba_key_map,
        to_hf_model=mamba_to_hf,
        weights_from_hf=_mamba_from_hf,
        weights_to_hf=_add_tied_head,
        accepts=lambda m: isinstance(m, MambaLM) and m.config.version == 2,
    )
)


# ---------------------------------------------------------------------- RWKV-4


def rwkv_config_from_hf(cfg: dict[str, Any], weight_names: set[str]) -> RWKVConfig:
    return RWKVConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        attention_hidden_size=cfg.get("attention_hidden_size"),
        intermediate_size=cfg.get("intermediate_size"),
        layer_norm_epsilon=cfg.get("layer_norm_epsilon", 1e-5),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        **special_tokens(cfg),
    )


def rwkv_key_map(model: nn.Module) -> dict[str, str]:
    return _stack_map(
        model,
        {
            "embed_tokens.": "rwkv.embeddings.",
            "pre_ln.": "rwkv.blocks.0.pre_ln.",
            "layers.": "rwkv.blocks.",
            "norm_f.": "rwkv.ln_out.",
            "lm_head.": "head.",
        },
    )


def _rwkv_from_hf(weights: dict[str, Tensor], config: RWKVConfig) -> dict[str, Tensor]:
    return _drop_tied(weights, config.tie_word_embeddings, "head.weight")


def rwkv_to_hf(model: nn.Module) -> nn.Module:
    assert isinstance(model, RWKVLM)
    c = model.config
    tf = require_transformers()
    cfg = tf.RwkvConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_hidden_layers,
        attention_hidden_size=c.attention_hidden_size,
        intermediate_size=c.intermediate_size,
        layer_norm_epsilon=c.layer_norm_epsilon,
        rescale_every=0,
        tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        pad_token_id=c.pad_token_id,
    )
    return tf.RwkvForCausalLM(cfg)


RWKV = register_converter(
    Converter(
        model_type="rwkv",
        hf_classes={"RwkvForCausalLM": ""},
        attnlab_class=RWKVLM,
        config_from_hf=rwkv_config_from_hf,
        build=RWKVLM,
        key_map=rwkv_key_map,
        to_hf_model=rwkv_to_hf,
        weights_from_hf=_rwkv_from_hf,
        weights_to_hf=_add_tied_head,
    )
)
