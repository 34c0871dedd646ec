"""The decoder's one forward over its layers, after validation (:class:`DecoderLM`).

Shape notation: ``B`` batch, ``L`` new tokens, ``D`` width, ``V`` vocabulary.

:meth:`DecoderLM.forward` and :meth:`DecoderLM.decode_step` check their inputs and call
:func:`run_layers`: the embedding extras, one attention plan per sliding window
(:func:`~attnlab.models.decoder_attention.attention_plans`), every layer with its cache,
the final norm and the output head. The flat serving forward (one ``[1, N]`` row of many
sequences) is :func:`attnlab.models.flat.decoder_forward_flat`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from attnlab.cache.base import LayerCache, ModelCache, Start
from attnlab.functional.masks import MaskPattern
from attnlab.models._checkpoint import call_layer, checkpointing
from attnlab.models.decoder_attention import attention_plans

if TYPE_CHECKING:
    from attnlab.models.decoder import DecoderLM

__all__ = ["run_layers"]


def run_layers(
    model: DecoderLM,
    x: Tensor,
    *,
    start: Start,
    mask: Tensor | None,
    position_ids: Tensor | None,
    cache: ModelCache | None,
    logits_to_keep: int,
    output_attentions: bool,
    output_hidden_states: bool,
    output_router_logits: bool = False,
    extra: MaskPattern | None = None,
    backend: str | None = None,
    head: bool = True,
    key_slots: Tensor | None = None,
) -> tuple[Tensor, tuple[Tensor, ...] | None, tuple[Tensor, ...] | None, tuple[Tensor, ...] | None]:
    """The one forward, after validation: ``(logits, hidden states, attentions, router
    logits)``; ``extra`` is a user pattern combined with the model's own (no cache);
    ``head=False`` returns the final hidden states ``[B, L, D]`` in the logits' place;
    ``key_slots``: the static cache's slots a decode step reads (``DecoderLM.decode_step``)."""
    n = x.shape[1]
    device = x.device
    q_slots = start + torch.arange(n, device=device)[None]  # [1, L]
    positions = q_slots if position_ids is None else position_ids
    x = model._embed_extras(x, positions)
    plans = attention_plans(
        model, x, start, mask, positions, q_slots, cache, output_attentions, extra, backend,
        key_slots,
    )  # fmt: skip
    hidden: list[Tensor] = [x] if output_hidden_states else []
    attentions: list[Tensor] = []
    router_logits: list[Tensor] = []
    layer_caches: Iterator[LayerCache | None] = (
        iter(cache.layers) if cache is not None else iter([None] * len(model.layers))
    )
    ckpt = checkpointing(model, cached=cache is not None)
    for layer, layer_cache, window in zip(model.layers, layer_caches, model.layer_windows):
        # a KV cache, or the mixer's own state in a hybrid's other layers
        x, w, _, r = call_layer(layer, ckpt, x, plans[window], layer_cache)
        if output_attentions and w is not None:  # attention layers only
            attentions.append(w)
        if output_hidden_states:
            hidden.append(x)
        if output_router_logits and r is not None:
            router_logits.append(r)
    x = model.norm(x)
    if output_hidden_states:
        hidden[-1] = x
    if logits_to_keep:
        x = x[:, -logits_to_keep:]
    logits = model._head(x) if head else x  # [B, L, V] (or [B, L, D])
    return (
        logits,
        tuple(hidden) if output_hidden_states else None,
        tuple(attentions) if output_attentions else None,
        tuple(router_logits) if output_router_logits else None,
    )
