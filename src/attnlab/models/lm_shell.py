"""What every causal language model of attnlab shares, whatever its layers mix.

The shell of :class:`~attnlab.models.decoder.DecoderLM` (attention, linear, recurrent
and hybrid mixers), and so of its presets (Mamba, Mamba-2, RWKV-4 and RetNet,
:mod:`attnlab.models.recurrent`): token embeddings, a stack of layers with one cache
entry each, a final norm and an LM head (the embeddings when tied),
``generate``/``stream`` through :mod:`attnlab.generation`, and the same checks of a forward's inputs (the token ids or
embeddings, ``attention_mask``, ``position_ids`` and the cache it continues).

Shape notation: ``B`` batch, ``L`` new tokens, ``T`` tokens so far (cached + new).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from attnlab.cache.base import ModelCache
from attnlab.cache.recurrent import RecurrentState
from attnlab.functional._checks import (
    check_binary_mask,
    check_index_range,
    check_integer_tensor,
    check_tensor,
)

__all__ = ["CausalLMShell"]


class CausalLMShell(nn.Module):
    """The parts of a causal language model that do not depend on its layers.

    Subclasses set ``config`` (with ``vocab_size`` and ``hidden_size``), ``embed_tokens``
    and ``lm_head`` (None when tied to the embeddings).
    """

    is_encoder_decoder = False
    config: Any
    embed_tokens: nn.Embedding
    lm_head: nn.Module | None

    def num_parameters(self) -> int:
        """Number of parameters (tied matrices counted once)."""
        return sum(p.numel() for p in self.parameters())

    @property
    def output_weight(self) -> Tensor:
        """The LM head's ``[V, D]`` matrix (the token embeddings when tied; expanded to
        float when they are quantized)."""
        if self.lm_head is None:
            return self.embed_tokens.weight
        return cast(Tensor, self.lm_head.weight)

    def prepare_inference(
        self,
        *,
        rows: Sequence[int] = (1, 2, 4, 8, 16, 32),
        kernel: str = "auto",
        fuse: bool | None = None,
    ) -> CausalLMShell:
        """Lay out the float linears (and a tied head) for ``rows``-row decode steps, each
        kernel chosen by measurement, with q/k/v and gate/up fused unless ``fuse=False``;
        see :func:`attnlab.models.inference.pack_model`
        (``attnlab.models.inference.unpack_model`` undoes it). Returns the model.

        Raises:
            ValueError: the model is in training mode.
        """
        from attnlab.models.inference import pack_model

        return cast(CausalLMShell, pack_model(self, rows=rows, kernel=kernel, fuse=fuse))

    def generate(self, input_ids: Tensor, max_new_tokens: int, **kwargs: Any) -> Tensor:
        """Generate tokens; see :func:`attnlab.generation.generate` for the arguments."""
        # generation/ sits above models/; imported here, at call time, on purpose.
        from attnlab.generation.generate import generate

        return generate(self, input_ids, max_new_tokens, **kwargs)

    def stream(self, input_ids: Tensor, max_new_tokens: int, **kwargs: Any) -> Iterator[Tensor]:
        """Yield new tokens ``[B]`` as they come; see :func:`attnlab.generation.stream`."""
        from attnlab.generation.generate import stream

        return stream(self, input_ids, max_new_tokens, **kwargs)

    def _embed_tokens(self, input_ids: Tensor | None, inputs_embeds: Tensor | None) -> Tensor:
        """``[B, L, D]``: the embeddings of ``input_ids`` (checked against the vocabulary),
        or ``inputs_embeds`` checked (shape, and the weights' dtype)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        d = self.config.hidden_size
        if inputs_embeds is not None:
            check_tensor("inputs_embeds", inputs_embeds)
            if (
                inputs_embeds.dim() != 3
                or inputs_embeds.shape[-1] != d
                or inputs_embeds.shape[:2].numel() == 0
            ):
                raise ValueError(
                    f"inputs_embeds must be (batch, seq_len, {d}) with at least one token, "
                    f"got {tuple(inputs_embeds.shape)}"
                )
            want = self.embed_tokens.weight.dtype
            if want.is_floating_point and inputs_embeds.dtype != want:
                raise TypeError(
                    f"inputs_embeds is {inputs_embeds.dtype}, the model's weights are {want}: "
                    f"pass inputs_embeds.to({want}) or convert the model"
                )
            return inputs_embeds
        ids = check_integer_tensor("input_ids", input_ids)
        if ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq_len), got shape {tuple(ids.shape)}")
        if ids.numel() == 0:
            raise ValueError(
                f"input_ids has no tokens (shape {tuple(ids.shape)}); a model needs at least "
                "one token per row"
            )
        check_index_range("token ids of input_ids", ids, self.config.vocab_size, bound="vocab_size")
        return self.embed_tokens(ids)

    def _check_cache(self, cache: ModelCache, dtype: torch.dtype) -> None:
        """A cache continued by this model: one entry per layer, and recurrent states of
        the dtype the model computes in."""
        layers = getattr(self, "layers", ())
        if len(cache.layers) != len(layers):
            raise ValueError(
                f"past_key_values has {len(cache.layers)} layer states, the model has "
                f"{len(layers)} layers (start one with model.new_cache())"
            )
        for i, layer in enumerate(cache.layers):
            if not isinstance(layer, RecurrentState):
                continue
            other = next((t.dtype for t in layer._tensors() if t.dtype != dtype), None)
            if other is not None:
                raise TypeError(
                    f"past_key_values: layer {i} holds {other} states, written by a model of "
                    f"another dtype; this model computes in {dtype} (start a new cache, or "
                    "convert the model to the cache's dtype)"
                )

    @staticmethod
    def _check_mask(attention_mask: Tensor | None, b: int, total: int) -> Tensor | None:
        """``attention_mask [B, T]`` checked (1/0, batch ``b``, ``total`` = cached + new
        tokens), or None when it masks nothing."""
        if attention_mask is None:
            return None
        check_binary_mask("attention_mask", attention_mask)
        if attention_mask.shape[0] != b:
            raise ValueError(
                f"attention_mask must be (batch, cached + new tokens) with batch {b} as the "
                f"input ids, got shape {tuple(attention_mask.shape)}"
            )
        if attention_mask.shape[1] != total:
            raise ValueError(
                f"attention_mask covers {attention_mask.shape[1]} tokens, but cached + new "
                f"tokens = {total}"
            )
        return None if bool(attention_mask.bool().all()) else attention_mask

    @staticmethod
    def _check_position_ids(position_ids: Tensor, b: int, n: int) -> Tensor:
        """``position_ids`` as ``[B|1, L]``, checked against batch ``b`` and ``n`` new tokens."""
        check_tensor("position_ids", position_ids)
        pos = position_ids if position_ids.dim() == 2 else position_ids.unsqueeze(0)
        if pos.shape[-1] != n or pos.shape[0] not in (1, b):
            raise ValueError(
                f"position_ids must be ({b}, {n}) or ({n},), got {tuple(position_ids.shape)}"
            )
        return pos
