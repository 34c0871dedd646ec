"""The plumbing the hybrid converters share (Jamba, Qwen3-Next, RecurrentGemma, LFM2, Bamba).

Each of those architectures is a :class:`~attnlab.models.decoder.DecoderLM` with a
``DecoderConfig.layers`` layout of attention and recurrent mixers; what differs between
them is the config mapping and a table of sub-module names. What they have in common
lives here: the special token ids in both directions, the per-layer key map driven by a
name table, the set of settings a layout gives one mixer, and the registration of the
converter itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypedDict

from torch import Tensor, nn

from attnlab.interop.hf import Converter, register_converter
from attnlab.interop.llama import _first, add_tied_head, claims, drop_tied_head
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.linear_layout import LinearLayerConfig

__all__ = [
    "SpecialTokens",
    "hybrid_converter",
    "layer_key_map",
    "linear_settings",
    "special_tokens",
    "special_tokens_to_hf",
]


class SpecialTokens(TypedDict):
    """The special token ids, as keywords of both configs."""

    pad_token_id: int | None
    bos_token_id: int | None
    eos_token_id: int | None


def special_tokens(cfg: Mapping[str, Any]) -> SpecialTokens:
    """``pad_token_id``, ``bos_token_id``, ``eos_token_id`` of a transformers config dict:
    the first of a list, and ``None`` for an id outside ``[0, vocab_size)``."""
    vocab = cfg["vocab_size"]

    def token(name: str) -> int | None:
        t = _first(cfg.get(name))
        return t if t is not None and 0 <= t < vocab else None

    return SpecialTokens(
        pad_token_id=token("pad_token_id"),
        bos_token_id=token("bos_token_id"),
        eos_token_id=token("eos_token_id"),
    )


def special_tokens_to_hf(c: DecoderConfig) -> SpecialTokens:
    """The same three ids of an attnlab config, as transformers config keywords."""
    return SpecialTokens(
        pad_token_id=c.pad_token_id, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id
    )


def layer_key_map(model: nn.Module, parts: Mapping[str, str], *, final_norm: str) -> dict[str, str]:
    """attnlab keys -> transformers keys of a hybrid decoder.

    Args:
        model: the :class:`DecoderLM`.
        parts: attnlab sub-module path -> transformers sub-module path within one layer;
            the first entry that is the key's path or a prefix of it names the key.
        final_norm: transformers' name of the final norm under ``model.``.

    Returns:
        ``{attnlab key: transformers key}`` for the embeddings, the final norm, an untied
        head and every layer key that ``parts`` names.
    """
    assert isinstance(model, DecoderLM)
    m = {
        "embed_tokens.weight": "model.embed_tokens.weight",
        "norm.weight": f"model.{final_norm}.weight",
    }
    if model.lm_head is not None:
        m["lm_head.weight"] = "lm_head.weight"
    for key in model.state_dict():
        if not key.startswith("layers."):
            continue
        i, rest = key[len("layers.") :].split(".", 1)
        for ours, theirs in parts.items():
            if rest == ours or rest.startswith(ours + "."):
                m[key] = f"model.layers.{i}.{theirs}{rest[len(ours) :]}"
                break
    return m


def linear_settings(c: DecoderConfig, mixer: str) -> set[LinearLayerConfig]:
    """The distinct :class:`LinearLayerConfig` of the layers whose mixer is ``mixer``
    (a layer without one counts as the default); an architecture that has one setting
    for all of them checks that this set has one member."""
    return {s.linear or LinearLayerConfig() for s in c.layer_specs if s.mixer == mixer}


def hybrid_converter(
    *,
    model_type: str,
    hf_class: str,
    config_from_hf: Callable[[dict[str, Any], set[str]], DecoderConfig],
    key_map: Callable[[nn.Module], dict[str, str]],
    to_hf_model: Callable[[nn.Module], nn.Module],
    mixer: str,
    weights_from_hf: Callable[[dict[str, Tensor], Any], dict[str, Tensor]] = drop_tied_head,
    weights_to_hf: Callable[[dict[str, Tensor], nn.Module], dict[str, Tensor]] = add_tied_head,
    accepts: Callable[[nn.Module], bool] | None = None,
) -> Converter:
    """Register the converter of a hybrid :class:`DecoderLM` architecture.

    Args:
        model_type: transformers' ``config.model_type``.
        hf_class: the transformers causal-LM class name (its keys carry no prefix).
        config_from_hf: the config mapping.
        key_map: attnlab keys -> transformers keys (:func:`layer_key_map` with the
            architecture's name table).
        to_hf_model: attnlab model -> an empty transformers model.
        mixer: the recurrent mixer that marks the architecture: ``to_hf`` picks this
            converter for a model whose config names ``model_type``, or names none and has
            a layer of this mixer.
        weights_from_hf: applied to transformers' weights first (default: drop a tied
            head's copy).
        weights_to_hf: applied before loading into transformers (default: add a tied
            head's copy).
        accepts: replaces the rule that ``mixer`` gives, where an architecture has its own.

    Returns:
        The registered :class:`~attnlab.interop.hf.Converter`.
    """

    def _claims(model: Any) -> bool:
        return claims(model, model_type, lambda c: any(s.mixer == mixer for s in c.layer_specs))

    return register_converter(
        Converter(
            model_type=model_type,
            hf_classes={hf_class: ""},
            attnlab_class=DecoderLM,
            config_from_hf=config_from_hf,
            build=DecoderLM,
            key_map=key_map,
            to_hf_model=to_hf_model,
            weights_from_hf=weights_from_hf,
            weights_to_hf=weights_to_hf,
            accepts=accepts if accepts is not None else _claims,
        )
    )
