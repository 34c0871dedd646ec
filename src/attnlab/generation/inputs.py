"""What a generation checks and prepares before its first step: inputs, token ids, caches.

Shape notation: ``B`` batch, ``P`` prompt length (padding included).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.functional._checks import check_binary_mask, check_int, check_tensor

__all__ = [
    "check_cache_room",
    "check_fresh_cache",
    "check_inputs",
    "check_token_id",
    "eos_tensor",
    "quantized_cache",
]


def eos_tensor(eos_token_id: int | Sequence[int] | None, device: torch.device) -> Tensor | None:
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.tensor(ids, dtype=torch.long, device=device)


def check_inputs(
    model: nn.Module, input_ids: Tensor, max_new_tokens: int, attention_mask: Tensor | None
) -> None:
    check_tensor("input_ids", input_ids)
    if input_ids.dim() != 2 or input_ids.dtype.is_floating_point or input_ids.shape[1] == 0:
        raise ValueError(
            f"input_ids must be a non-empty integer (batch, prompt_len) tensor, got "
            f"{input_ids.dtype} {tuple(input_ids.shape)}"
        )
    check_int("max_new_tokens", max_new_tokens, min_value=0)
    if attention_mask is not None:
        check_binary_mask("attention_mask", attention_mask)
        if attention_mask.shape[0] != input_ids.shape[0]:
            raise ValueError(
                f"batch sizes differ: input_ids has {input_ids.shape[0]} rows, attention_mask "
                f"has {attention_mask.shape[0]}"
            )
        if tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got "
                f"{tuple(attention_mask.shape)}"
            )
    config = model.config
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and not getattr(model, "is_encoder_decoder", False):
        p = input_ids.shape[1]
        if p > limit:
            raise ValueError(
                f"the prompt has {p} tokens, longer than the model's maximum positions "
                f"(max_position_embeddings={limit})"
            )
        if getattr(config, "position_embedding", None) in ("learned", "sinusoidal") and (
            p + max_new_tokens > limit
        ):
            raise ValueError(
                f"prompt ({p}) + max_new_tokens ({max_new_tokens}) = {p + max_new_tokens} exceeds "
                f"the model's learned positions (max_position_embeddings={limit})"
            )


def quantized_cache(model: nn.Module, kv_dtype: str, cache: Any, compile: bool, needed: int) -> Any:
    """A fresh model cache whose KV layers hold ``kv_dtype`` (:mod:`attnlab.cache.quantized`)."""
    from attnlab.cache.kv_cache import DynamicKVCache
    from attnlab.cache.quantized import KV_DTYPES, QuantizedKVCache

    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {list(KV_DTYPES)} or None, got {kv_dtype!r}")
    if cache is not None or compile:
        raise ValueError(
            "kv_dtype makes its own cache and runs eagerly: pass neither cache= nor compile=True"
        )
    fresh = model.new_cache(max_length=needed)  # type: ignore[operator]
    if not all(type(c) is DynamicKVCache for c in fresh.layers):
        raise ValueError(
            "kv_dtype quantizes growing KV caches; this model's layers carry "
            f"{sorted({type(c).__name__ for c in fresh.layers})}"
        )
    fresh.layers = [QuantizedKVCache(kv_dtype=kv_dtype, capacity=needed) for _ in fresh.layers]
    return fresh


def check_token_id(name: str, value: object, vocab_size: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int token id, got {type(value).__name__} {value!r}")
    if not 0 <= value < vocab_size:
        raise ValueError(f"{name} must lie in [0, vocab_size={vocab_size}), got {value}")


def check_fresh_cache(cache: Any) -> None:
    """Refuse a cache that already holds tokens (e.g. left by a stream stopped early).

    Generation writes the prompt at slot 0; continuing a cache that holds another
    call's tokens would attend to them and silently change the output.
    """
    length = getattr(cache, "length", 0)
    if length:
        raise ValueError(
            f"cache holds {length} token(s) from an earlier call (a stream stopped early "
            "leaves its tokens behind); call cache.reset() or pass a new cache"
        )


def check_cache_room(cache: Any, needed: int) -> None:
    for layer in getattr(cache, "layers", []):
        room = getattr(layer, "max_length", None)
        if room is not None and room - layer.length < needed:
            raise ValueError(
                f"cache too small: the prompt and max_new_tokens need {needed} slots, the cache "
                f"has {room - layer.length} free (max_length={room}, {layer.length} used)"
            )
