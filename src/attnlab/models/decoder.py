"""Decoder-only language models (GPT-2, Llama, Mistral, BLOOM) built from :class:`DecoderConfig`.

Shape notation: ``B`` batch, ``L`` new tokens, ``T`` slots so far (cached + new),
``S`` keys attended to, ``D`` width, ``V`` vocabulary.

The config names the components; :func:`build_decoder_layer` turns them into a
:class:`~attnlab.modules.decoder_layer.DecoderLayer` with a
:class:`~attnlab.modules.attention.MultiHeadAttention` that holds the position
component (a shared :class:`RotaryEmbedding` or :class:`ALiBi`).

Positions and masks follow transformers' ``generate``: with an ``attention_mask`` of a
left-padded batch, each row's positions start at 0 at its first real token
(``cumsum(mask) - 1``), and masks compare slots (see :mod:`attnlab.cache.kv_cache`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import Tensor, nn

from attnlab.cache.kv_cache import (
    DynamicKVCache,
    KVCache,
    ModelCache,
    SlidingWindowKVCache,
    StaticKVCache,
)
from attnlab.functional._checks import check_binary_mask, check_tensor, check_token_ids
from attnlab.functional.losses import causal_lm_loss
from attnlab.functional.masks import MaskPattern, causal, sliding_window
from attnlab.functional.routing import load_balancing_loss, router_z_loss
from attnlab.functional.slot_masks import positions_from_mask, slot_mask
from attnlab.models._checkpoint import call_layer, checkpointing
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.layout import LayerSpec, MoEConfig
from attnlab.models.mixers import MixerParts, build_mixer
from attnlab.models.outputs import CausalLMOutput
from attnlab.modules.decoder_layer import DecoderLayer
from attnlab.modules.experts import Experts, Router
from attnlab.modules.mlp import FeedForward, GatedFeedForward
from attnlab.modules.moe import MoEBlock
from attnlab.modules.norms import RMSNorm
from attnlab.modules.position import LearnedPositionalEmbedding, SinusoidalPositionalEmbedding
from attnlab.modules.rotary import RotaryEmbedding
from attnlab.modules.score_bias import ALiBi

__all__ = ["DecoderLM", "build_decoder_layer", "build_feed_forward", "build_moe", "make_norm"]

CacheKind = Literal["dynamic", "static"]


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    """``"rmsnorm"`` -> :class:`RMSNorm`, ``"layernorm"`` -> ``nn.LayerNorm``."""
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps)
    raise ValueError(f"unknown norm {kind!r}; expected 'rmsnorm' or 'layernorm'")


def build_feed_forward(config: DecoderConfig, spec: LayerSpec) -> nn.Module | None:
    """The feed-forward ``spec`` names: dense (the config's ``mlp``), MoE, or None."""
    d = config.hidden_size
    if spec.ffn == "none":
        return None
    if spec.ffn == "moe":
        assert spec.moe is not None
        return build_moe(spec.moe, d, bias=config.mlp_bias)
    if config.mlp == "gated":
        return GatedFeedForward(
            embed_dim=d,
            hidden_dim=config.intermediate_size,
            activation=config.hidden_act,
            bias=config.mlp_bias,
        )
    return FeedForward(
        embed_dim=d,
        hidden_dim=config.intermediate_size,
        activation=config.hidden_act,
        bias=config.mlp_bias,
    )


def build_moe(moe: MoEConfig, embed_dim: int, *, bias: bool = False) -> MoEBlock:
    """A :class:`MoEBlock` as ``moe`` describes it (the shared expert is a gated or plain
    feed-forward like the routed ones)."""
    shared: nn.Module | None = None
    if moe.shared_expert_intermediate_size:
        kind = GatedFeedForward if moe.expert_mlp == "gated" else FeedForward
        shared = kind(
            embed_dim=embed_dim,
            hidden_dim=moe.shared_expert_intermediate_size,
            activation=moe.hidden_act,
            bias=bias,
        )
    return MoEBlock(
        router=Router(
            embed_dim=embed_dim,
            num_experts=moe.num_experts,
            top_k=moe.top_k,
            router=moe.router,
            normalize=moe.norm_topk_prob,
            capacity_factor=moe.capacity_factor,
            jitter=moe.router_jitter,
            noise_std=moe.router_noise_std,
        ),
        experts=Experts(
            num_experts=moe.num_experts,
            embed_dim=embed_dim,
            hidden_dim=moe.intermediate_size,
            activation=moe.hidden_act,
            gated=moe.expert_mlp == "gated",
        ),
        shared_expert=shared,
        shared_expert_gate=nn.Linear(embed_dim, 1, bias=False) if moe.shared_expert_gate else None,
        dispatch=moe.dispatch,
        capacity_factor=moe.capacity_factor,
    )


def build_decoder_layer(
    config: DecoderConfig,
    *,
    layer_index: int = 0,
    rotary: nn.Module | None = None,
    score_bias: nn.Module | None = None,
    backend: str = "auto",
) -> DecoderLayer:
    """Decoder layer ``layer_index`` as ``config.layer_specs`` describes it (its mixer from
    :mod:`attnlab.models.mixers`, its feed-forward), with the shared position components."""
    d = config.hidden_size
    spec = config.layer_specs[layer_index]
    mixer = build_mixer(
        spec.mixer,
        config,
        MixerParts(layer_index=layer_index, rotary=rotary, score_bias=score_bias, backend=backend),
    )
    ff = build_feed_forward(config, spec)
    return DecoderLayer(
        self_attention=mixer,
        feed_forward=ff,
        self_attn_norm=make_norm(config.norm, d, config.norm_eps),
        ffn_norm=make_norm(config.norm, d, config.norm_eps) if ff is not None else None,
        norm_position="pre",
        dropout=config.hidden_dropout,
    )


class DecoderLM(nn.Module):
    """A pre-LN decoder-only Transformer with a language-model head.

    GPT-2 (Radford et al., 2019), Llama (Touvron et al., 2023), Mistral (Jiang et al.,
    2023) and BLOOM (BigScience, 2022) are configurations of this one class.

    Args:
        config: the architecture.
        backend: attention backend for every layer.
    """

    is_encoder_decoder = False

    def __init__(self, config: DecoderConfig, *, backend: str = "auto") -> None:
        super().__init__()
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"config must be a DecoderConfig, got {type(config).__name__}")
        self.config = config
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.embed_positions: nn.Module | None = None
        if config.position_embedding == "learned":
            self.embed_positions = LearnedPositionalEmbedding(
                num_positions=config.max_position_embeddings, embed_dim=d
            )
        elif config.position_embedding == "sinusoidal":
            self.embed_positions = SinusoidalPositionalEmbedding(
                num_positions=config.max_position_embeddings, embed_dim=d
            )
        self.embed_norm = (
            make_norm(config.norm, d, config.norm_eps) if config.embedding_norm else None
        )
        self.rotary: RotaryEmbedding | None = None
        self.alibi: ALiBi | None = None
        if config.position_embedding == "rope":
            assert config.head_dim is not None
            self.rotary = RotaryEmbedding(
                dim=config.head_dim,
                base=config.rope_theta,
                scaling=config.rope_scaling,
                max_position_embeddings=config.max_position_embeddings,
                convention="interleaved" if config.rope_convention == "interleaved" else "half",
            )
        elif config.position_embedding == "alibi":
            self.alibi = ALiBi(num_heads=config.num_attention_heads)
        self.layers = nn.ModuleList(
            build_decoder_layer(
                config, layer_index=i, rotary=self.rotary, score_bias=self.alibi, backend=backend
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = make_norm(config.norm, d, config.norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(d, config.vocab_size, bias=False)
        )
        self.dropout = nn.Dropout(config.hidden_dropout)

    def num_parameters(self) -> int:
        """Number of parameters (tied matrices counted once)."""
        return sum(p.numel() for p in self.parameters())

    @property
    def output_weight(self) -> Tensor:
        """The LM head's ``[V, D]`` matrix (the token embeddings when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def new_cache(self, *, kind: CacheKind = "dynamic", max_length: int = 0) -> ModelCache:
        """Empty caches for every layer.

        Args:
            kind: ``"dynamic"`` (growing; a rolling window cache for sliding-window
                models) or ``"static"`` (preallocated, static shapes).
            max_length: slots to preallocate (required for ``"static"``).
        """
        window = self.config.sliding_window
        if kind == "static":
            return ModelCache.build(len(self.layers), lambda: StaticKVCache(max_length=max_length))
        if kind != "dynamic":
            raise ValueError(f"cache kind must be 'dynamic' or 'static', got {kind!r}")
        if window is not None:
            return ModelCache.build(len(self.layers), lambda: SlidingWindowKVCache(window=window))
        return ModelCache.build(len(self.layers), lambda: DynamicKVCache(capacity=max_length))

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | MaskPattern | None = None,
        position_ids: Tensor | None = None,
        past_key_values: ModelCache | None = None,
        use_cache: bool = False,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        inputs_embeds: Tensor | None = None,
        logits_to_keep: int = 0,
        output_router_logits: bool = False,
        labels: Tensor | None = None,
    ) -> CausalLMOutput:
        """Next-token logits for ``L`` new tokens, after the cached ones.

        Args:
            input_ids: ``[B, L]`` token ids (or ``inputs_embeds [B, L, D]``).
            attention_mask: ``[B, T]`` of 1/0 over cached + new tokens (``T = cached + L``);
                left padding is supported. Without a cache, also a pattern that the
                causal mask (and the sliding window) is combined with, e.g.
                ``document(doc_ids)`` for packed training rows.
            position_ids: ``[B, L]`` positions; default from ``attention_mask``
                (``cumsum - 1``) or ``cached .. cached+L-1``.
            past_key_values: a :class:`ModelCache` (from :meth:`new_cache` or a previous
                output); updated in place.
            use_cache: start a cache when none is given and return it.
            output_attentions: return each layer's attention weights.
            output_hidden_states: return the embeddings and every layer's output.
            inputs_embeds: ``[B, L, D]`` instead of ``input_ids``.
            logits_to_keep: compute logits for the last ``n`` tokens only (0 = all).
            output_router_logits: return each MoE layer's router logits ``[B * L, E]``
                and the load-balancing ``aux_loss`` over them (transformers'
                ``load_balancing_loss_func``: padding left out by ``attention_mask``).
            labels: ``[B, L]`` target ids (usually ``input_ids``; ``-100`` = ignored);
                the output's ``loss`` is the next-token cross-entropy, shifted as
                transformers shifts it.

        Returns:
            :class:`CausalLMOutput`.

        Raises:
            ValueError: mismatched batch sizes or lengths, positions beyond a learned
                table, a cache too small.
        """
        x = self._embed_tokens(input_ids, inputs_embeds)  # [B, L, D]
        b, n = x.shape[:2]
        pattern = attention_mask if isinstance(attention_mask, MaskPattern) else None
        if pattern is not None and (past_key_values is not None or use_cache):
            raise ValueError("a pattern attention_mask is for uncached forwards (no cache)")
        pad_mask = None if isinstance(attention_mask, MaskPattern) else attention_mask
        cache = past_key_values
        if cache is None and use_cache:
            cache = self.new_cache()
        start = cache.length if cache is not None else 0
        total = start + n
        mask = self._check_mask(pad_mask, b, total)
        full_pos = positions_from_mask(mask) if mask is not None else None  # [B, T]
        positions = self._positions(position_ids, full_pos, b, start, n, x.device)
        if self.embed_positions is not None:
            x = x + self.embed_positions(positions)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        x = self.dropout(x)

        self_mask, is_causal, k_slots = self._self_mask(cache, mask, start, n, x.device)
        attn_mask: Tensor | MaskPattern | None = self_mask
        if pattern is not None:
            window = self.config.sliding_window
            combined = causal() & pattern
            attn_mask = combined & sliding_window(window - 1) if window is not None else combined
            is_causal = False
        key_positions = None
        if self.alibi is not None:
            slots = k_slots if k_slots is not None else torch.arange(total, device=x.device)
            key_positions = (
                full_pos[:, slots.clamp(0, total - 1)] if full_pos is not None else slots
            )
        hidden: list[Tensor] = [x] if output_hidden_states else []
        attentions: list[Tensor] = []
        router_logits: list[Tensor] = []
        layer_caches: Iterator[KVCache | None] = (
            iter(cache.layers) if cache is not None else iter([None] * len(self.layers))
        )
        ckpt = checkpointing(self, cached=cache is not None)
        for layer, layer_cache in zip(self.layers, layer_caches):
            x, w, _, r = call_layer(
                layer,
                ckpt,
                x,
                attn_mask=attn_mask,
                is_causal=is_causal,
                positions=positions,
                key_positions=key_positions,
                cache=layer_cache,
                cache_start=start,
                need_weights=output_attentions,
            )
            if output_attentions:
                assert w is not None
                attentions.append(w)
            if output_hidden_states:
                hidden.append(x)
            if output_router_logits and r is not None:
                router_logits.append(r)
        x = self.norm(x)
        if output_hidden_states:
            hidden[-1] = x
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = nn.functional.linear(x, self.output_weight)  # [B, L, V]
        aux_loss = None
        if output_router_logits and router_logits:
            # a pattern (packed rows) has no padding to leave out of the balance
            pad = attention_mask if isinstance(attention_mask, Tensor) else None
            aux_loss = self._aux_loss(router_logits, pad, b, n)
        return CausalLMOutput(
            logits=logits,
            loss=causal_lm_loss(logits, labels) if labels is not None else None,
            past_key_values=cache if (use_cache or past_key_values is not None) else None,
            hidden_states=tuple(hidden) if output_hidden_states else None,
            attentions=tuple(attentions) if output_attentions else None,
            router_logits=tuple(router_logits) if output_router_logits else None,
            aux_loss=aux_loss,
        )

    # ------------------------------------------------------------------ pieces

    def router_loss(
        self, router_logits: tuple[Tensor, ...], attention_mask: Tensor | None = None
    ) -> Tensor:
        """The routers' training loss to add to the language-model loss:
        ``router_aux_loss_coef * load_balancing + router_z_loss_coef * z_loss`` (Fedus et
        al., 2021; Zoph et al., 2022), with the first MoE layer's coefficients.

        Args:
            router_logits: ``output.router_logits`` (``output_router_logits=True``).
            attention_mask: ``[B, L]`` 1/0 over the same tokens, padding left out.
        """
        moe = self.config.layer_specs[self.config.moe_layers[0]].moe
        assert moe is not None
        loss = moe.router_aux_loss_coef * load_balancing_loss(
            router_logits, moe.num_experts, moe.top_k, attention_mask
        )
        if moe.router_z_loss_coef:
            loss = loss + moe.router_z_loss_coef * router_z_loss(router_logits, attention_mask)
        return loss

    def _aux_loss(
        self, router_logits: list[Tensor], attention_mask: Tensor | None, b: int, n: int
    ) -> Tensor:
        """Load-balancing loss over the MoE layers (the first MoE layer's ``E`` and ``k``)."""
        moe = self.config.layer_specs[self.config.moe_layers[0]].moe
        assert moe is not None
        mask = attention_mask[:, -n:] if attention_mask is not None else None  # [B, L]
        return load_balancing_loss(router_logits, moe.num_experts, moe.top_k, mask)

    def _embed_tokens(self, input_ids: Tensor | None, inputs_embeds: Tensor | None) -> Tensor:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is not None:
            check_tensor("inputs_embeds", inputs_embeds)
            if (
                inputs_embeds.dim() != 3
                or inputs_embeds.shape[-1] != self.config.hidden_size
                or inputs_embeds.shape[:2].numel() == 0
            ):
                raise ValueError(
                    f"inputs_embeds must be (batch, seq_len, {self.config.hidden_size}) with at "
                    f"least one token, got {tuple(inputs_embeds.shape)}"
                )
            return inputs_embeds
        assert input_ids is not None
        check_token_ids("input_ids", input_ids, self.config.vocab_size)
        return self.embed_tokens(input_ids)

    @staticmethod
    def _check_mask(attention_mask: Tensor | None, b: int, total: int) -> Tensor | None:
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
    def _positions(
        position_ids: Tensor | None,
        full_pos: Tensor | None,
        b: int,
        start: int,
        n: int,
        device: torch.device,
    ) -> Tensor:
        if position_ids is not None:
            check_tensor("position_ids", position_ids)
            pos = position_ids if position_ids.dim() == 2 else position_ids.unsqueeze(0)
            if pos.shape[-1] != n or pos.shape[0] not in (1, b):
                raise ValueError(
                    f"position_ids must be ({b}, {n}) or ({n},), got {tuple(position_ids.shape)}"
                )
            return pos
        if full_pos is not None:
            return full_pos[:, start:]  # [B, L]
        return torch.arange(start, start + n, device=device)[None]  # [1, L]

    def _self_mask(
        self,
        cache: ModelCache | None,
        mask: Tensor | None,
        start: int,
        n: int,
        device: torch.device,
    ) -> tuple[Tensor | None, bool, Tensor | None]:
        """``(attn_mask, is_causal, key slots or None)`` shared by all layers."""
        window = self.config.sliding_window
        first: KVCache | None = cache.layers[0] if cache is not None and cache.layers else None
        contiguous = first is None or isinstance(first, DynamicKVCache)
        if mask is None and window is None and contiguous:
            if start == 0:
                return None, n > 1, None
            if n == 1:
                return None, False, None
        k_slots = (
            first.key_slots(start, n, device)
            if first is not None
            else torch.arange(start + n, device=device)
        )
        q_slots = torch.arange(start, start + n, device=device)
        return slot_mask(q_slots, k_slots, attention_mask=mask, window=window), False, k_slots

    def generate(self, input_ids: Tensor, max_new_tokens: int, **kwargs: Any) -> Tensor:
        """Generate tokens; see :func:`attnlab.generation.generate` for the arguments."""
        # generation/ sits above models/; imported here, at call time, on purpose.
        from attnlab.generation.generate import generate

        return generate(self, input_ids, max_new_tokens, **kwargs)

    def stream(self, input_ids: Tensor, max_new_tokens: int, **kwargs: Any) -> Iterator[Tensor]:
        """Yield new tokens ``[B]`` as they come; see :func:`attnlab.generation.stream`."""
        from attnlab.generation.generate import stream

        return stream(self, input_ids, max_new_tokens, **kwargs)
