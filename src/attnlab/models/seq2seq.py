"""Encoder-decoder language models (the original Transformer, T5) from :class:`Seq2SeqConfig`.

Shape notation: ``B`` batch, ``S`` encoder length, ``L`` new decoder tokens,
``D`` width, ``V`` vocabulary.

The encoder is a stack of :class:`~attnlab.modules.encoder_layer.EncoderLayer`; the
decoder a stack of :class:`~attnlab.modules.decoder_layer.DecoderLayer` with causal
self-attention and cross-attention to the encoder output. T5's relative position
bias is one :class:`~attnlab.modules.positions.T5RelativePositionBias` per stack; its
score modifier rides on the stack's mask pattern (``padding(mask).with_scores(bias)``
in the encoder, ``causal() & padding(mask)`` with decoder slots in the decoder), so no
layer receives a dense ``[B, H, L, S]`` bias. Training backends that apply it tile by
tile (``tiled``) return the table's gradient from their backward; ``reference`` and
``sparse`` by autograd.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.backends.call import AttentionCall
from attnlab.backends.plan import make_plan
from attnlab.cache.base import ModelCache
from attnlab.cache.kv_cache import DynamicKVCache
from attnlab.functional._checks import check_binary_mask, check_tensor, check_token_ids
from attnlab.functional.losses import shift_right, token_loss
from attnlab.functional.masks import MaskPattern, causal, full, padding, padding_mask
from attnlab.models._checkpoint import call_layer, checkpointing
from attnlab.models.outputs import Seq2SeqLMOutput
from attnlab.models.seq2seq_config import Seq2SeqConfig
from attnlab.modules.attention import MultiHeadAttention
from attnlab.modules.decoder_layer import CrossInputs, DecoderLayer
from attnlab.modules.encoder_layer import EncoderLayer
from attnlab.modules.linear import make_linear
from attnlab.modules.mlp import FeedForward, GatedFeedForward
from attnlab.modules.norms import make_norm
from attnlab.modules.positions import (
    LearnedPositionalEmbedding,
    SinusoidalPositionalEmbedding,
    T5RelativePositionBias,
)

__all__ = ["Seq2SeqLM"]


class Seq2SeqLM(nn.Module):
    """An encoder-decoder Transformer with a language-model head.

    Args:
        config: the architecture.
        backend: attention backend for every layer.
    """

    is_encoder_decoder = True

    def __init__(self, config: Seq2SeqConfig, *, backend: str = "auto") -> None:
        super().__init__()
        if not isinstance(config, Seq2SeqConfig):
            raise TypeError(f"config must be a Seq2SeqConfig, got {type(config).__name__}")
        self.config = config
        self.backend = backend
        d = config.d_model
        self.shared = nn.Embedding(config.vocab_size, d)
        self.embed_positions: nn.Module | None = None
        if config.position_embedding == "sinusoidal":
            self.embed_positions = SinusoidalPositionalEmbedding(
                num_positions=config.max_position_embeddings, embed_dim=d
            )
        elif config.position_embedding == "learned":
            self.embed_positions = LearnedPositionalEmbedding(
                num_positions=config.max_position_embeddings, embed_dim=d
            )
        self.encoder_bias: T5RelativePositionBias | None = None
        self.decoder_bias: T5RelativePositionBias | None = None
        if config.position_embedding == "t5_relative":
            self.encoder_bias = self._relative_bias(bidirectional=True)
            self.decoder_bias = self._relative_bias(bidirectional=False)
        self.encoder_layers = nn.ModuleList(
            EncoderLayer(
                attention=self._attention(),
                feed_forward=self._feed_forward(),
                attn_norm=self._norm(),
                ffn_norm=self._norm(),
                norm_position="pre" if config.norm_position == "pre" else "post",
                dropout=config.dropout_rate,
            )
            for _ in range(config.num_layers)
        )
        assert config.num_decoder_layers is not None
        self.decoder_layers = nn.ModuleList(
            DecoderLayer(
                self_attention=self._attention(),
                cross_attention=self._attention(),
                feed_forward=self._feed_forward(),
                self_attn_norm=self._norm(),
                cross_attn_norm=self._norm(),
                ffn_norm=self._norm(),
                norm_position="pre" if config.norm_position == "pre" else "post",
                dropout=config.dropout_rate,
            )
            for _ in range(config.num_decoder_layers)
        )
        pre = config.norm_position == "pre"
        self.encoder_norm = self._norm() if pre else None
        self.decoder_norm = self._norm() if pre else None
        self.lm_head = (
            None if config.tie_word_embeddings else make_linear(d, config.vocab_size, bias=False)
        )
        self.dropout = nn.Dropout(config.dropout_rate)

    # ------------------------------------------------------------------ builders

    def _relative_bias(self, *, bidirectional: bool) -> T5RelativePositionBias:
        c = self.config
        return T5RelativePositionBias(
            num_heads=c.num_heads,
            num_buckets=c.relative_attention_num_buckets,
            max_distance=c.relative_attention_max_distance,
            bidirectional=bidirectional,
        )

    def _attention(self) -> MultiHeadAttention:
        c = self.config
        return MultiHeadAttention(
            embed_dim=c.d_model,
            num_heads=c.num_heads,
            head_dim=c.d_kv,
            bias=c.bias,
            backend=self.backend,
            scale=c.attention_scale,
        )

    def _feed_forward(self) -> nn.Module:
        c = self.config
        cls = GatedFeedForward if c.mlp == "gated" else FeedForward
        return cls(embed_dim=c.d_model, hidden_dim=c.d_ff, activation=c.dense_act_fn, bias=c.bias)

    def _norm(self) -> nn.Module:
        return make_norm(self.config.norm, self.config.d_model, self.config.layer_norm_epsilon)

    # ------------------------------------------------------------------ running

    @property
    def output_weight(self) -> Tensor:
        return self.shared.weight if self.lm_head is None else self.lm_head.weight

    def new_cache(self, *, max_length: int = 0) -> ModelCache:
        """Self-attention and cross-attention caches for every decoder layer."""
        return ModelCache.build(
            len(self.decoder_layers), lambda: DynamicKVCache(capacity=max_length), cross=True
        )

    def _embed(self, ids: Tensor, positions: Tensor) -> Tensor:
        x = self.shared(ids)  # [B, L, D]
        if self.config.scale_embeddings:
            x = x * math.sqrt(self.config.d_model)
        if self.embed_positions is not None:
            x = x + self.embed_positions(positions)
        return self.dropout(x)

    def encode(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        *,
        output_attentions: bool = False,
    ) -> Tensor:
        """Encoder output ``[B, S, D]`` for ``input_ids [B, S]`` (mask 1/0 ``[B, S]``)."""
        return self._encode(input_ids, attention_mask, output_attentions)[0]

    def _encode(
        self, input_ids: Tensor, attention_mask: Tensor | None, output_attentions: bool
    ) -> tuple[Tensor, list[Tensor]]:
        check_token_ids("input_ids", input_ids, self.config.vocab_size)
        s = input_ids.shape[-1]
        x = self._embed(input_ids, torch.arange(s, device=input_ids.device)[None])
        pad = self._key_padding(attention_mask, input_ids.shape[0], s)
        mask: MaskPattern | None = pad
        if self.encoder_bias is not None:
            mask = (full() if pad is None else pad).with_scores(self.encoder_bias.score_mod())
        weights: list[Tensor] = []
        ckpt = checkpointing(self)
        for layer in self.encoder_layers:
            x, w = call_layer(layer, ckpt, x, attn_mask=mask, need_weights=output_attentions)
            if output_attentions:
                assert w is not None
                weights.append(w)
        if self.encoder_norm is not None:
            x = self.dropout(self.encoder_norm(x))
        return x, weights

    @staticmethod
    def _key_padding(attention_mask: Tensor | None, b: int, s: int) -> MaskPattern | None:
        """``padding(attention_mask)`` over the ``s`` encoder keys, or None without padding."""
        if attention_mask is None:
            return None
        check_binary_mask("attention_mask", attention_mask, (b, s))
        keep = padding_mask(attention_mask)  # [B, 1, 1, S]
        return None if bool(keep.all()) else padding(attention_mask)

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        decoder_input_ids: Tensor | None = None,
        decoder_attention_mask: Tensor | None = None,
        encoder_outputs: Tensor | None = None,
        past_key_values: ModelCache | None = None,
        use_cache: bool = False,
        output_attentions: bool = False,
        logits_to_keep: int = 0,
        labels: Tensor | None = None,
    ) -> Seq2SeqLMOutput:
        """Decoder logits for ``decoder_input_ids`` given the source.

        Args:
            input_ids: ``[B, S]`` source tokens (not needed with ``encoder_outputs``).
            attention_mask: ``[B, S]`` 1/0 over the source.
            decoder_input_ids: ``[B, L]`` new decoder tokens (after the cached ones).
            decoder_attention_mask: ``[B, T]`` 1/0 over cached + new decoder tokens.
            encoder_outputs: ``[B, S, D]`` precomputed encoder output.
            past_key_values: decoder caches (:meth:`new_cache`), updated in place.
            use_cache: start a cache if none is given, and return it.
            output_attentions: return attention weights of every layer.
            logits_to_keep: logits of the last ``n`` tokens only (0 = all).
            labels: ``[B, L]`` decoder targets (``-100`` = ignored); without
                ``decoder_input_ids`` the decoder reads the labels shifted right after
                ``decoder_start_token_id``, as transformers' T5 does. The output's
                ``loss`` is their mean cross-entropy.

        Returns:
            :class:`Seq2SeqLMOutput`.
        """
        enc_weights: list[Tensor] = []
        if encoder_outputs is None:
            if input_ids is None:
                raise ValueError("pass input_ids or encoder_outputs")
            encoder_outputs, enc_weights = self._encode(
                input_ids, attention_mask, output_attentions
            )
        if decoder_input_ids is None and labels is not None:
            check_tensor("labels", labels)
            decoder_input_ids = shift_right(
                labels,
                start_token_id=self.config.decoder_start_token_id,
                pad_token_id=self.config.pad_token_id,
            )
        if decoder_input_ids is None:
            raise ValueError("decoder_input_ids (or labels) is required")
        check_token_ids("decoder_input_ids", decoder_input_ids, self.config.vocab_size)
        b, n = decoder_input_ids.shape[0], decoder_input_ids.shape[-1]
        if encoder_outputs.shape[0] != b:
            raise ValueError(
                f"batch sizes differ: decoder_input_ids has {b} rows, the encoder output "
                f"{encoder_outputs.shape[0]}"
            )
        enc_mask = self._key_padding(attention_mask, b, encoder_outputs.shape[1])
        cache = past_key_values
        if cache is None and use_cache:
            cache = self.new_cache()
        start = cache.length if cache is not None else 0
        device = decoder_input_ids.device
        positions = torch.arange(start, start + n, device=device)[None]  # [1, L]
        x = self._embed(decoder_input_ids, positions)
        if decoder_attention_mask is not None:
            check_binary_mask("decoder_attention_mask", decoder_attention_mask, (b, start + n))
        # The decoder's slots are 0..T-1 whatever its cache holds: keys at arange(T).
        pattern: MaskPattern = causal()
        if decoder_attention_mask is not None:
            pattern = pattern & padding(decoder_attention_mask)
        if self.decoder_bias is not None:
            pattern = pattern.with_scores(self.decoder_bias.score_mod())
        k_slots = torch.arange(start + n, device=device)[None]  # [1, T]
        plan = make_plan(
            self._call(x, start + n, pattern, output_attentions, positions=True),
            backend=self.backend,
            pattern=pattern,
            positions=positions,
            q_positions=positions,
            k_positions=k_slots,
            start=start,
        )
        cross_plan = make_plan(
            self._call(x, encoder_outputs.shape[1], enc_mask, output_attentions, positions=False),
            backend=self.backend,
            pattern=enc_mask,
        )
        self_w: list[Tensor] = []
        cross_w: list[Tensor] = []
        layer_caches: Iterator[Any] = iter(cache.layers) if cache else iter([None] * n_layers(self))
        cross_caches: Iterator[Any] = (
            iter(cache.cross)
            if cache is not None and cache.cross
            else iter([None] * n_layers(self))
        )
        ckpt = checkpointing(self, cached=cache is not None)
        for layer, lc, cc in zip(self.decoder_layers, layer_caches, cross_caches):
            cross = CrossInputs(encoder_outputs, cross_plan, cc)
            x, sw, cw, _ = call_layer(layer, ckpt, x, plan, lc, cross)
            if output_attentions:
                assert sw is not None and cw is not None
                self_w.append(sw)
                cross_w.append(cw)
        if self.decoder_norm is not None:
            x = self.dropout(self.decoder_norm(x))
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        if self.lm_head is None and self.config.rescale_output:
            x = x * self.config.d_model**-0.5
        logits = nn.functional.linear(x, self.output_weight)  # [B, L, V]
        return Seq2SeqLMOutput(
            logits=logits,
            loss=token_loss(logits, labels) if labels is not None else None,
            past_key_values=cache if (use_cache or past_key_values is not None) else None,
            encoder_last_hidden_state=encoder_outputs,
            decoder_attentions=tuple(self_w) if output_attentions else None,
            cross_attentions=tuple(cross_w) if output_attentions else None,
            encoder_attentions=tuple(enc_weights) if output_attentions and enc_weights else None,
        )

    def _call(
        self,
        x: Tensor,
        keys: int,
        pattern: MaskPattern | None,
        need_weights: bool,
        *,
        positions: bool,
    ) -> AttentionCall:
        """The call of a decoder attention (self or cross) over ``keys`` keys."""
        c = self.config
        b, n = x.shape[:2]
        assert c.d_kv is not None
        h, e = c.num_heads, c.d_kv
        return AttentionCall(
            query_shape=(b, h, n, e),
            key_shape=(b, h, keys, e),
            value_shape=(b, h, keys, e),
            dtype=x.dtype,
            device=x.device,
            mask="none" if pattern is None else "pattern",
            pattern=pattern,
            is_causal=False,
            dropout_p=0.0,
            enable_gqa=False,
            needs_grad=torch.is_grad_enabled()
            and (x.requires_grad or self.output_weight.requires_grad),
            return_weights=need_weights,
            positions=positions,
        )

    def generate(self, input_ids: Tensor, max_new_tokens: int, **kwargs: Any) -> Tensor:
        """Generate decoder tokens; see :func:`attnlab.generation.generate`."""
        from attnlab.generation.generate import generate

        return generate(self, input_ids, max_new_tokens, **kwargs)

    def stream(self, input_ids: Tensor, max_new_tokens: int, **kwargs: Any) -> Iterator[Tensor]:
        """Yield decoder tokens ``[B]`` as they come; see :func:`attnlab.generation.stream`."""
        from attnlab.generation.generate import stream

        return stream(self, input_ids, max_new_tokens, **kwargs)


def n_layers(model: Seq2SeqLM) -> int:
    return len(model.decoder_layers)
