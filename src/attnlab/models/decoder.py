"""Decoder-only language models (GPT-2, Llama, Mistral, BLOOM) built from :class:`DecoderConfig`.

Shape notation: ``B`` batch, ``L`` new tokens, ``T`` slots so far (cached + new),
``S`` keys attended to, ``D`` width, ``V`` vocabulary.

The config names the components; :func:`build_decoder_layer` turns them into a
:class:`~attnlab.modules.decoder_layer.DecoderLayer` with a
:class:`~attnlab.modules.attention.MultiHeadAttention` that holds the shared
:class:`~attnlab.modules.positions.RotaryEmbedding` (RoPE models).

One path: every forward describes its attention as a pattern evaluated on slots,
``causal() & sliding_window(W - 1) & padding(attention_mask)``, with ALiBi as a score
modifier, and passes the queries' and keys' slots (``q_positions``, ``k_positions``,
the latter from the cache's ``key_slots``); the backend decides what to materialise.
Positions of a left-padded batch follow transformers' ``generate``: each row starts at
0 at its first real token (``cumsum(mask) - 1``).

:meth:`DecoderLM.decode_step` is the same forward without the entry checks, with the
slot as an int or a tensor: ``generate`` runs it eagerly, or compiles it over a
:class:`~attnlab.cache.StaticKVCache` (fixed shapes, no host syncs, no graph breaks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from torch import Tensor, nn

from attnlab.backends.call import AttentionCall
from attnlab.backends.select import choose_call
from attnlab.cache.base import KVCache, LayerCache, ModelCache, Start
from attnlab.cache.kv_cache import DynamicKVCache, SlidingWindowKVCache, StaticKVCache
from attnlab.functional.losses import causal_lm_loss, chunked_causal_lm_loss
from attnlab.functional.masks import MaskPattern
from attnlab.functional.positions import alibi_slopes, positions_from_mask
from attnlab.functional.routing import load_balancing_loss, router_z_loss
from attnlab.models.decoder_attention import (
    attention_call,
    attention_keys,
    attention_pattern,
    explain,
    first_kv,
)
from attnlab.models.decoder_build import build_decoder_layer, build_feed_forward, build_moe
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.decoder_parts import (
    AttentionGroup,
    layer_rotaries,
    score_mods,
)
from attnlab.models.decoder_run import run_layers
from attnlab.models.flat import FlatBatch, decoder_forward_flat
from attnlab.models.lm_shell import CausalLMShell
from attnlab.models.mixers import get_mixer
from attnlab.models.outputs import CausalLMOutput
from attnlab.modules.linear import make_linear
from attnlab.modules.norms import make_norm
from attnlab.modules.positions import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEmbedding,
)
from attnlab.modules.quant_linear import QuantEmbedding

if TYPE_CHECKING:
    from attnlab.backends.linear_pack import PackedLinear

__all__ = ["DecoderLM", "build_decoder_layer", "build_feed_forward", "build_moe", "make_norm"]

CacheKind = Literal["dynamic", "static"]


class DecoderLM(CausalLMShell):
    """A pre-LN decoder-only Transformer with a language-model head.

    GPT-2 (Radford et al., 2019), Llama (Touvron et al., 2023), Mistral (Jiang et al.,
    2023) and BLOOM (BigScience, 2022) are configurations of this one class.

    Args:
        config: the architecture.
        backend: attention backend for every layer.
    """

    def __init__(self, config: DecoderConfig, *, backend: str = "auto") -> None:
        super().__init__()
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"config must be a DecoderConfig, got {type(config).__name__}")
        self.config = config
        self.backend = backend
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
        self.alibi_slopes: Tensor | None = None  # ALiBi (Press et al., 2022): a score modifier
        layer_rotary = layer_rotaries(config)
        if config.position_embedding == "rope":
            self.rotary = next((r for r in layer_rotary if r is not None), None)
        elif config.position_embedding == "alibi":
            self.alibi_slopes = alibi_slopes(config.num_attention_heads)
        # ALiBi and soft-capping, made once (a compiled step builds no Python objects)
        self._score_mods = score_mods(config, self.alibi_slopes)
        self._unscored = len(self._score_mods) == 0
        #: each layer's sliding window (None: global attention)
        self.layer_windows = tuple(config.layer_window(i) for i in range(config.num_hidden_layers))
        self.layers = nn.ModuleList(
            build_decoder_layer(config, layer_index=i, rotary=layer_rotary[i], backend=backend)
            for i in range(config.num_hidden_layers)
        )
        self.norm = make_norm(config.norm, d, config.norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings else make_linear(d, config.vocab_size, bias=False)
        )
        self.dropout = nn.Dropout(config.hidden_dropout)
        #: a tied head laid out for few-row inference (:func:`attnlab.models.inference.pack_model`)
        self.packed_head: PackedLinear | None = None
        #: set by loaders that find them beside the weights (``attnlab.from_gguf``): a
        #: transformers tokenizer, and generation defaults under transformers' names
        self.tokenizer: Any = None
        self.generation_config: dict[str, Any] = {}

    @property
    def decoder_config(self) -> DecoderConfig:
        """The :class:`DecoderConfig` this shell runs: ``config`` itself, except for a
        preset that keeps another architecture's config (:mod:`attnlab.models.recurrent`)."""
        return cast(DecoderConfig, self.config)

    @property
    def prefill_again_at(self) -> int | None:
        """The slot at which ``generate`` encodes the whole sequence again: LongRoPE's
        ``original_max_position_embeddings`` (its frequencies change past it), else None."""
        scaling = self.decoder_config.rope_scaling or {}
        if scaling.get("rope_type") != "longrope":
            return None
        return int(scaling["original_max_position_embeddings"])

    def lm_logits(self, x: Tensor) -> Tensor:
        """``[B, L, D] -> [B, L, V]``: the LM head, a quantized one included (a tied
        quantized table multiplies as the head it is)."""
        if self.lm_head is not None:
            return self.lm_head(x)
        table = self.embed_tokens
        if isinstance(table, QuantEmbedding):
            return table.logits(x)
        if self.packed_head is not None and self.packed_head.weight is table.weight:
            return self.packed_head(x)
        return nn.functional.linear(x, table.weight)

    def _float_param(self) -> Tensor:
        """A float parameter that every model keeps (the final norm's): dtype and device."""
        return cast(Tensor, self.norm.weight)

    def new_cache(
        self,
        *,
        kind: CacheKind = "dynamic",
        max_length: int = 0,
        batch_size: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> ModelCache:
        """Empty caches for every layer.

        Args:
            kind: ``"dynamic"`` (growing; a rolling window cache for sliding-window
                models) or ``"static"`` (preallocated, static shapes: the compiled
                decode step's cache).
            max_length: slots to preallocate (required for ``"static"``).
            batch_size: rows; with ``"static"``, the buffers are allocated now.
            dtype: the static buffers' dtype (default: the model's).
            device: the static buffers' device (default: the model's).

        Raises:
            ValueError: an unknown kind, or ``"static"`` without a positive ``max_length``.
        """
        if kind not in ("dynamic", "static"):
            raise ValueError(f"cache kind must be 'dynamic' or 'static', got {kind!r}")

        def kv_cache(window: int | None) -> KVCache:
            if kind == "static":
                weight = self._float_param()
                assert self.decoder_config.num_key_value_heads is not None
                assert self.decoder_config.head_dim is not None
                return StaticKVCache(
                    max_length=max_length,
                    batch_size=batch_size,
                    num_kv_heads=self.decoder_config.num_key_value_heads,
                    head_dim=self.decoder_config.head_dim,
                    dtype=weight.dtype if dtype is None else dtype,
                    device=weight.device if device is None else device,
                )
            if window is not None:
                return SlidingWindowKVCache(window=window)
            return DynamicKVCache(capacity=max_length)

        layers: list[LayerCache] = []
        for spec, window in zip(self.decoder_config.layer_specs, self.layer_windows):
            own = get_mixer(spec.mixer).new_cache  # a hybrid mixes KV caches and states
            layers.append(
                kv_cache(window) if own is None else own(self.decoder_config, kind, max_length)
            )
        return ModelCache(layers=layers)

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
        return_logits: bool = True,
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
            return_logits: False: ``logits=None``, the loss computed without them
                (:func:`~attnlab.functional.losses.chunked_causal_lm_loss`).

        Returns:
            :class:`CausalLMOutput`.

        Raises:
            ValueError: mismatched batch sizes or lengths, positions beyond a learned
                table, a cache too small.
        """
        if not return_logits and (labels is None or logits_to_keep):
            given = f"labels={'given' if labels is not None else None}, {logits_to_keep=}"
            raise ValueError(f"return_logits=False needs labels and logits_to_keep=0: {given}")
        x = self._embed_tokens(input_ids, inputs_embeds)  # [B, L, D]
        b, n = x.shape[:2]
        extra = attention_mask if isinstance(attention_mask, MaskPattern) else None
        if extra is not None and (past_key_values is not None or use_cache):
            raise ValueError("a pattern attention_mask is for uncached forwards (no cache)")
        cache = past_key_values
        if cache is not None:
            self._check_cache(cache, x.dtype)
        elif use_cache:
            cache = self.new_cache()
        start = cache.length if cache is not None else 0
        pad_mask = None if isinstance(attention_mask, MaskPattern) else attention_mask
        mask = self._check_mask(pad_mask, b, start + n)
        if position_ids is not None:
            position_ids = self._check_position_ids(position_ids, b, n)
        elif mask is not None:
            position_ids = positions_from_mask(mask)[:, start:]  # [B, L]
        logits, hidden, attentions, routers = run_layers(
            self,
            x,
            start=start,
            mask=mask,
            position_ids=position_ids,
            cache=cache,
            logits_to_keep=logits_to_keep,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            output_router_logits=output_router_logits,
            extra=extra,
            head=return_logits,
        )
        aux_loss = None
        if output_router_logits and routers:
            # a pattern (packed rows) has no padding to leave out of the balance
            aux_loss = self._aux_loss(list(routers), pad_mask, b, n)
        loss = None
        if labels is not None and return_logits:
            loss = causal_lm_loss(logits, labels)
        elif labels is not None:  # ``logits`` holds the final hidden states
            v = self.decoder_config.vocab_size
            loss = chunked_causal_lm_loss(logits, self._head, labels, vocab_size=v)
        return CausalLMOutput(
            logits=logits if return_logits else None,
            loss=loss,
            past_key_values=cache if (use_cache or past_key_values is not None) else None,
            hidden_states=hidden,
            attentions=attentions,
            router_logits=routers,
            aux_loss=aux_loss,
        )

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
        moe = self.decoder_config.layer_specs[self.decoder_config.moe_layers[0]].moe
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
        moe = self.decoder_config.layer_specs[self.decoder_config.moe_layers[0]].moe
        assert moe is not None
        mask = attention_mask[:, -n:] if attention_mask is not None else None  # [B, L]
        return load_balancing_loss(router_logits, moe.num_experts, moe.top_k, mask)

    def decode_step(
        self,
        input_ids: Tensor,
        *,
        cache: ModelCache,
        start: Start,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        backend: str | None = None,
        key_slots: Tensor | None = None,
    ) -> Tensor:
        """The forward of one decoding step, trusted: logits ``[B, L, V]`` of the last token.

        ``generate`` calls it after checking its own inputs once; it runs eagerly, or
        compiled over a :class:`~attnlab.cache.StaticKVCache` with ``start`` a 0-d long
        tensor (fixed shapes, no host sync, no data-dependent Python branch: the
        compiled graph is the same for every step).

        Args:
            input_ids: ``[B, L]`` new tokens (ids in range).
            cache: the model's caches; the new keys go to slots ``start..start+L-1``.
            start: slot of the first new token (int, or a 0-d long tensor).
            position_ids: ``[B, L]`` or ``[1, L]`` positions (default: the slots).
            attention_mask: ``[B, T]`` 1/0 over every slot the keys may hold (``T``
                at least ``start + L``), or None when no row is padded.
            backend: the attention backend, resolved beforehand (:meth:`decode_backend`;
                a compiled step cannot consult the registry's context); default: ask the
                registry once for this forward.
            key_slots: ``[1, S]`` the slots ``0 .. S-1`` with ``S = start + L``: a
                :class:`~attnlab.cache.StaticKVCache` hands over (and the attention
                reads) only these, the slots written so far, instead of all of its
                ``max_length``; a compiled step takes ``S`` as a dynamic size (one
                graph for every step). None: every slot, the causal pattern hiding
                the unwritten ones.
        """
        x = self.embed_tokens(input_ids)  # [B, L, D]
        logits, _, _, _ = run_layers(
            self,
            x,
            start=start,
            mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            logits_to_keep=1,
            output_attentions=False,
            output_hidden_states=False,
            backend=backend,
            key_slots=key_slots,
        )
        return logits

    def decode_backend(
        self,
        input_ids: Tensor,
        *,
        cache: ModelCache,
        start: Start,
        attention_mask: Tensor | None = None,
        key_slots: Tensor | None = None,
    ) -> str:
        """The backend the registry picks for :meth:`decode_step` with these arguments."""
        n = input_ids.shape[1]
        d = self.decoder_config.hidden_size
        x = self._float_param().new_empty((input_ids.shape[0], n, d))  # shape and dtype only
        first = first_kv(cache, self.layer_windows, self.layer_windows[0])
        q_slots = start + torch.arange(n, device=x.device)[None]
        pattern, is_causal, _, k_pos = attention_pattern(
            self, first, attention_mask, start, n, q_slots, window=self.layer_windows[0],
            key_slots=key_slots,
        )  # fmt: skip
        s = attention_keys(first, n, k_pos, key_slots)
        return self._backend_for(attention_call(self, x, pattern, is_causal, s, False, first))

    def _backend_for(self, call: AttentionCall) -> str:
        """The model's backend name, or the registry's choice for ``call`` under ``auto``."""
        return choose_call(call, self.backend).chosen

    def explain_attention(
        self, input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> list[AttentionGroup]:
        """How an uncached forward of ``input_ids`` would attend, one entry per distinct
        window: the layers, their window and pattern, and the registry's
        :class:`~attnlab.backends.call.Explanation` of the backend they run
        (``str()`` of an entry prints it). Runs no layer."""
        return explain(self, input_ids, attention_mask)

    def _embed_extras(self, x: Tensor, positions: Tensor) -> Tensor:
        """What follows the token embedding: Gemma's scale, absolute positions, the
        embedding norm, dropout."""
        if self.decoder_config.embedding_scale is not None:  # Gemma: sqrt(D) in the weights' dtype
            x = x * torch.tensor(self.decoder_config.embedding_scale, dtype=x.dtype)
        if self.embed_positions is not None:
            x = x + self.embed_positions(positions)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        if self.training and self.decoder_config.hidden_dropout > 0:
            x = self.dropout(x)
        return x

    def _head(self, x: Tensor) -> Tensor:
        """Logits ``[.., V]`` of final hidden states (Gemma 2's soft-cap included)."""
        logits = self.lm_logits(x)
        cap = self.decoder_config.final_logit_softcapping
        if cap is not None:  # Gemma 2's output soft-cap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def forward_flat(self, input_ids: Tensor, batch: FlatBatch, cache: ModelCache) -> Tensor:
        """One serving step over a flat row (see :mod:`attnlab.models.flat`): logits
        ``[n_s, V]`` of each sequence's last token."""
        return decoder_forward_flat(self, input_ids, batch, cache)
