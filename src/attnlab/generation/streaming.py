"""Streaming decoding with attention sinks (Xiao et al., 2023): a fixed-size cache for any length.

``generate(model, ids, n, cache=sink_cache(model, window=1024))`` decodes past the model's
context with ``sinks + window`` keys per layer; see :class:`attnlab.cache.SinkKVCache`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnlab.cache import ModelCache, SinkKVCache
from attnlab.cache.base import LayerCache

__all__ = ["is_sink_cache", "prefill_sink_cache", "sink_cache"]


def sink_cache(model: Any, *, window: int, sinks: int = 4) -> ModelCache:
    """A :class:`~attnlab.cache.ModelCache` of sink caches for ``model``'s attention layers.

    Recurrent layers of a hybrid keep their own state (already fixed-size).

    Args:
        model: a decoder (``DecoderLM``) with ``layers`` and ``config.layer_specs``.
        window: recent tokens each query attends to (itself included).
        sinks: first tokens kept (the paper keeps 4; 0 gives a plain window).

    Raises:
        ValueError: a model with sliding-window layers (they would attend to the sinks
            as well and change meaning), or learned/sinusoidal absolute positions (the
            stream runs past their table).
    """
    from attnlab.models.mixers import get_mixer

    # a recurrent preset (MambaLM, RWKVLM, RetNetLM) runs the DecoderConfig it maps to
    config = getattr(model, "decoder_config", None) or model.config
    specs = getattr(config, "layer_specs", None)
    if specs is None:
        raise TypeError(
            f"model: a sink cache needs a decoder with attention layers (DecoderLM or a "
            f"recurrent preset), got {type(model).__name__}"
        )
    if not any(get_mixer(spec.mixer).new_cache is None for spec in specs):
        raise ValueError(
            f"window: this model has no attention layers (mixers "
            f"{sorted({spec.mixer for spec in specs})}); its state is already a fixed size, so "
            f"a sink window would change nothing: decode it without one"
        )
    if getattr(config, "position_embedding", "rope") in ("learned", "sinusoidal"):
        raise ValueError(
            f"a sink cache needs relative positions (RoPE, ALiBi or none); this model uses "
            f"{config.position_embedding!r} absolute positions"
        )
    windows = getattr(model, "layer_windows", ())
    if any(w is not None for w in windows):
        raise ValueError(
            f"a sink cache replaces the window of every attention layer; this model has "
            f"sliding-window layers (windows {sorted({w for w in windows if w})})"
        )
    layers: list[LayerCache] = []
    for spec, layer in zip(specs, model.layers):
        own = get_mixer(spec.mixer).new_cache
        if own is not None:
            layers.append(own(config, "dynamic", 0))
            continue
        rotary = getattr(layer.self_attention, "rotary", None)
        layers.append(SinkKVCache(window=window, sinks=sinks, rotary=rotary))
    return ModelCache(layers=layers)


def is_sink_cache(cache: Any) -> bool:
    """Whether ``cache`` holds at least one :class:`~attnlab.cache.SinkKVCache`."""
    return any(isinstance(c, SinkKVCache) for c in getattr(cache, "layers", ()))


def prefill_sink_cache(model: Any, input_ids: Tensor, cache: ModelCache) -> Tensor:
    """Feed ``input_ids [B, P]`` through ``cache`` in the chunks a sink cache takes.

    Every token attends to what the cache keeps at its time (the sinks and the newest
    ``window`` tokens), as if the prompt had been decoded token by token.

    Returns:
        The logits of the last token, ``[B, 1, V]``.
    """
    sink = next(c for c in cache.layers if isinstance(c, SinkKVCache))
    logits: Tensor | None = None
    p = input_ids.shape[1]
    done = 0
    with torch.no_grad():
        while done < p:
            ns = 0 if sink.sink_k is None else sink.sink_k.shape[2]
            nr = 0 if sink.k is None else sink.k.shape[2]
            room = sink.window - nr + (sink.sinks - ns)
            n = min(max(room, 1), p - done)
            logits = model(
                input_ids[:, done : done + n],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits
            done += n
    assert logits is not None
    return logits
