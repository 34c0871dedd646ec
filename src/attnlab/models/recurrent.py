"""State-space and recurrent language models: Mamba, Mamba-2, RWKV-4 and RetNet.

Shape notation: ``B`` batch, ``L`` new tokens, ``T`` tokens so far (cached + new), ``D``
width, ``V`` vocabulary.

They follow :class:`~attnlab.models.decoder.DecoderLM`'s conventions: ``forward(input_ids,
attention_mask, position_ids, past_key_values, use_cache, labels, ...)`` returning a
:class:`CausalLMOutput`, ``new_cache()`` (a :class:`ModelCache` of one recurrent state per
layer, constant in size), ``generate``/``stream`` through :mod:`attnlab.generation`
unchanged. Left-padded batches equal each row run alone: every layer skips padding, so a
state starts at the row's first real token (transformers' Mamba only zeroes padded
inputs, and its RWKV ignores the mask).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.cache.kv_cache import ModelCache
from attnlab.cache.recurrent import RecurrentState, RetentionState, RWKVState
from attnlab.cache.state_slots import StateSlots
from attnlab.functional._checks import check_tensor
from attnlab.functional.positions import positions_from_mask
from attnlab.models.flat import FlatBatch, run_grouped
from attnlab.models.lm_shell import CausalLMShell
from attnlab.models.outputs import CausalLMOutput
from attnlab.models.recurrent_config import MambaConfig, RetNetConfig, RWKVConfig
from attnlab.modules.linear import make_linear
from attnlab.modules.mamba import Mamba2Mixer, MambaMixer
from attnlab.modules.norms import RMSNorm
from attnlab.modules.retention import MultiScaleRetention
from attnlab.modules.rwkv import RWKVChannelMix, RWKVTimeMix

__all__ = ["RWKVLM", "MambaLM", "RecurrentLM", "RetNetLM", "causal_lm_loss"]


def causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Cross-entropy of token ``t`` predicting ``labels[t+1]``, ignoring ``-100`` (transformers')."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        labels[:, 1:].reshape(-1).to(logits.device),
        ignore_index=-100,
    )


def _check_state_dtype(cache: ModelCache, dtype: torch.dtype) -> None:
    """A cache continued by this model holds states of the dtype it computes in."""
    for i, layer in enumerate(cache.layers):
        held: list[Tensor] = getattr(layer, "_tensors", list)()
        other = next((t.dtype for t in held if t.dtype != dtype), None)
        if other is not None:
            raise TypeError(
                f"past_key_values: layer {i} holds {other} states, written by a model of "
                f"another dtype; this model computes in {dtype} (start a new cache, or "
                "convert the model to the cache's dtype)"
            )


class RecurrentLM(CausalLMShell):
    """What the recurrent language models share: embeddings, blocks with states, LM head.

    Subclasses set ``embed_tokens``, ``layers`` (blocks taking ``(x, mask=, positions=,
    state=)``), ``norm_f``, ``lm_head`` (or None when tied) and implement :meth:`_new_state`.
    """

    layers: nn.ModuleList
    norm_f: nn.Module

    def _new_state(self, layer: int) -> RecurrentState:
        raise NotImplementedError

    def _embed(self, x: Tensor) -> Tensor:
        return x

    def new_cache(self, *, kind: str = "dynamic", max_length: int = 0) -> ModelCache:
        """One empty recurrent state per layer (fixed size: ``max_length`` is not needed).

        Args:
            kind: ``"dynamic"`` or ``"static"``: the same for a recurrent state, whose
                shapes never change.
            max_length: accepted for the decoders' signature; unused.
        """
        if kind not in ("dynamic", "static"):
            raise ValueError(f"cache kind must be 'dynamic' or 'static', got {kind!r}")
        return ModelCache(layers=[self._new_state(i) for i in range(len(self.layers))])  # type: ignore[misc]

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        past_key_values: ModelCache | None = None,
        use_cache: bool = False,
        labels: Tensor | None = None,
        output_hidden_states: bool = False,
        inputs_embeds: Tensor | None = None,
        logits_to_keep: int = 0,
    ) -> CausalLMOutput:
        """Next-token logits for ``L`` new tokens, after the cached ones.

        Args:
            input_ids: ``[B, L]`` token ids (or ``inputs_embeds [B, L, D]``).
            attention_mask: ``[B, T]`` 1/0 over cached + new tokens; left padding is skipped.
            position_ids: ``[B, L]`` positions (used by RetNet's rotation; default from the mask).
            past_key_values: a :class:`ModelCache` of recurrent states; updated in place.
            use_cache: start a cache when none is given and return it.
            labels: ``[B, L]`` target ids (``-100`` ignored); adds ``loss``.
            output_hidden_states: return the embeddings and every block's output.
            inputs_embeds: ``[B, L, D]`` instead of ``input_ids``.
            logits_to_keep: logits for the last ``n`` tokens only (0 = all).

        Raises:
            ValueError: token ids out of range, a mask or positions of the wrong shape, a
                cache of another model.
        """
        x = self._embed_tokens(input_ids, inputs_embeds)  # [B, L, D]
        b, n = x.shape[:2]
        cache = past_key_values
        if cache is None and use_cache:
            cache = self.new_cache()
        if cache is not None and len(cache.layers) != len(self.layers):
            raise ValueError(
                f"past_key_values has {len(cache.layers)} layer states, the model has "
                f"{len(self.layers)} layers"
            )
        if cache is not None:
            _check_state_dtype(cache, x.dtype)
        start = cache.length if cache is not None else 0
        mask, positions = self._mask_and_positions(attention_mask, position_ids, b, start, n, x)
        x = self._embed(x)
        hidden: list[Tensor] = [x] if output_hidden_states else []
        states: list[Any] = list(cache.layers) if cache is not None else [None] * len(self.layers)
        for layer, state in zip(self.layers, states):
            x = layer(x, mask=mask, positions=positions, state=state)
            if output_hidden_states:
                hidden.append(x)
        x = self.norm_f(x)
        if output_hidden_states:
            hidden[-1] = x
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = F.linear(x, self.output_weight)  # [B, L, V]
        out = CausalLMOutput(
            logits=logits,
            past_key_values=cache if (use_cache or past_key_values is not None) else None,
            hidden_states=tuple(hidden) if output_hidden_states else None,
        )
        if labels is not None:
            out.loss = causal_lm_loss(logits, labels)  # type: ignore[attr-defined]
        return out

    def forward_flat(self, input_ids: Tensor, batch: FlatBatch, cache: ModelCache) -> Tensor:
        """One serving step over a flat row ``input_ids [1, N]`` (:mod:`attnlab.models.flat`):
        every block runs each group of sequences over their state slots; logits
        ``[n_s, V]`` of each sequence's last token."""
        assert batch.state_slots is not None
        x = self._embed(self.embed_tokens(input_ids))  # [1, N, D]
        for layer, slots in zip(self.layers, cache.layers):
            assert isinstance(slots, StateSlots)

            def block(xg: Tensor, pos: Tensor, state: Any, layer: nn.Module = layer) -> Tensor:
                out: Tensor = layer(xg, mask=None, positions=pos, state=state)
                return out

            x = run_grouped(block, x, batch.layout, batch.positions, batch.state_slots, slots)
        x = self.norm_f(x.index_select(1, batch.last))  # [1, n_s, D]
        return F.linear(x, self.output_weight)[0]  # [n_s, V]

    # ------------------------------------------------------------------ pieces

    def _embed_tokens(self, input_ids: Tensor | None, inputs_embeds: Tensor | None) -> Tensor:
        d, v = self.config.hidden_size, self.config.vocab_size
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is not None:
            check_tensor("inputs_embeds", inputs_embeds)
            if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != d:
                raise ValueError(
                    f"inputs_embeds must be (batch, seq_len, {d}), got {tuple(inputs_embeds.shape)}"
                )
            want = self.embed_tokens.weight.dtype
            if inputs_embeds.dtype != want:
                raise TypeError(
                    f"inputs_embeds is {inputs_embeds.dtype}, the model's weights are {want}: "
                    f"pass inputs_embeds.to({want}) or convert the model"
                )
            if inputs_embeds.shape[1] == 0:
                raise ValueError("inputs_embeds has no tokens (seq_len 0); pass at least one")
            return inputs_embeds
        assert input_ids is not None
        check_tensor("input_ids", input_ids)
        if input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
            raise ValueError(
                f"input_ids must be integer (batch, seq_len), got {input_ids.dtype} "
                f"{tuple(input_ids.shape)}"
            )
        if input_ids.shape[1] == 0:
            raise ValueError(
                f"input_ids has no tokens (shape {tuple(input_ids.shape)}); pass at least one"
            )
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= v):
            raise ValueError(
                f"token ids must lie in [0, vocab_size={v}), got range "
                f"[{int(input_ids.min())}, {int(input_ids.max())}]"
            )
        return self.embed_tokens(input_ids)

    @staticmethod
    def _mask_and_positions(
        attention_mask: Tensor | None,
        position_ids: Tensor | None,
        b: int,
        start: int,
        n: int,
        x: Tensor,
    ) -> tuple[Tensor | None, Tensor]:
        """``(mask of the new tokens [B, L] or None, positions [B|1, L])``."""
        full_pos = None
        mask = None
        if attention_mask is not None:
            check_tensor("attention_mask", attention_mask)
            if attention_mask.dim() != 2 or attention_mask.shape[0] != b:
                raise ValueError(
                    f"attention_mask must be (batch, cached + new tokens) with batch {b}, got "
                    f"shape {tuple(attention_mask.shape)}"
                )
            if attention_mask.shape[1] != start + n:
                raise ValueError(
                    f"attention_mask covers {attention_mask.shape[1]} tokens, but cached + new "
                    f"tokens = {start + n}"
                )
            if not bool(attention_mask.bool().all()):
                mask = attention_mask[:, start:].to(x.device)
                full_pos = positions_from_mask(attention_mask)
        if position_ids is not None:
            check_tensor("position_ids", position_ids)
            pos = position_ids if position_ids.dim() == 2 else position_ids.unsqueeze(0)
            if pos.shape[-1] != n or pos.shape[0] not in (1, b):
                raise ValueError(
                    f"position_ids must be ({b}, {n}) or ({n},), got {tuple(position_ids.shape)}"
                )
            return mask, pos
        if full_pos is not None:
            return mask, full_pos[:, start:]
        return mask, torch.arange(start, start + n, device=x.device)[None]


# ---------------------------------------------------------------------- Mamba / Mamba-2


class MambaBlock(nn.Module):
    """``x + mixer(RMSNorm(x))`` (the residual block of Mamba and Mamba-2)."""

    def __init__(self, *, norm: nn.Module, mixer: MambaMixer | Mamba2Mixer) -> None:
        super().__init__()
        self.norm = norm
        self.mixer = mixer

    def forward(
        self, x: Tensor, *, mask: Tensor | None, positions: Tensor, state: Any = None
    ) -> Tensor:
        return x + self.mixer(self.norm(x), mask=mask, state=state)


def build_mamba_mixer(config: MambaConfig) -> MambaMixer | Mamba2Mixer:
    """The mixer of one Mamba (``version=1``) or Mamba-2 (``version=2``) block."""
    if config.version == 2:
        assert config.num_heads is not None
        return Mamba2Mixer(
            hidden_size=config.hidden_size,
            num_heads=config.num_heads,
            head_dim=config.head_dim,
            state_size=config.state_size,
            n_groups=config.n_groups,
            conv_kernel=config.conv_kernel,
            conv_bias=config.use_conv_bias,
            bias=config.use_bias,
            norm_eps=config.norm_eps,
            dt_limit=config.dt_limit,
            chunk_size=config.chunk_size,
        )
    assert config.dt_rank is not None
    return MambaMixer(
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        state_size=config.state_size,
        conv_kernel=config.conv_kernel,
        dt_rank=config.dt_rank,
        conv_bias=config.use_conv_bias,
        bias=config.use_bias,
        chunk_size=config.chunk_size,
    )


class MambaLM(RecurrentLM):
    """Mamba (Gu & Dao, 2023) or Mamba-2 (Dao & Gu, 2024) language model.

    Args:
        config: the architecture (``config.version`` picks the mixer).
    """

    def __init__(self, config: MambaConfig) -> None:
        super().__init__()
        if not isinstance(config, MambaConfig):
            raise TypeError(f"config must be a MambaConfig, got {type(config).__name__}")
        self.config = config
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.layers = nn.ModuleList(
            MambaBlock(norm=RMSNorm(d, eps=config.norm_eps), mixer=build_mamba_mixer(config))
            for _ in range(config.num_hidden_layers)
        )
        self.norm_f = RMSNorm(d, eps=config.norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings else make_linear(d, config.vocab_size, bias=False)
        )

    def _new_state(self, layer: int) -> RecurrentState:
        block = self.layers[layer]
        assert isinstance(block, MambaBlock)
        return block.mixer.new_state()


# ---------------------------------------------------------------------- RWKV-4


class RWKVBlock(nn.Module):
    """``x + TimeMix(LN(x))``, then ``x + ChannelMix(LN(x))``."""

    def __init__(self, config: RWKVConfig, layer_id: int) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.layer_norm_epsilon
        self.ln1 = nn.LayerNorm(d, eps=eps)
        self.ln2 = nn.LayerNorm(d, eps=eps)
        n = config.num_hidden_layers
        self.attention = RWKVTimeMix(
            hidden_size=d,
            attention_size=config.attention_hidden_size,
            chunk_size=config.chunk_size,
            layer_id=layer_id,
            num_layers=n,
        )
        self.feed_forward = RWKVChannelMix(
            hidden_size=d,
            intermediate_size=config.intermediate_size,
            layer_id=layer_id,
            num_layers=n,
        )

    def forward(
        self, x: Tensor, *, mask: Tensor | None, positions: Tensor, state: RWKVState | None = None
    ) -> Tensor:
        x = x + self.attention(self.ln1(x), mask=mask, state=state)
        return x + self.feed_forward(self.ln2(x), mask=mask, state=state)


class RWKVLM(RecurrentLM):
    """RWKV-4 language model (Peng et al., 2023).

    Args:
        config: the architecture.
    """

    def __init__(self, config: RWKVConfig) -> None:
        super().__init__()
        if not isinstance(config, RWKVConfig):
            raise TypeError(f"config must be an RWKVConfig, got {type(config).__name__}")
        self.config = config
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.pre_ln = nn.LayerNorm(d, eps=config.layer_norm_epsilon)
        self.layers = nn.ModuleList(RWKVBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm_f = nn.LayerNorm(d, eps=config.layer_norm_epsilon)
        self.lm_head = (
            None if config.tie_word_embeddings else make_linear(d, config.vocab_size, bias=False)
        )

    def _embed(self, x: Tensor) -> Tensor:
        return self.pre_ln(x)

    def _new_state(self, layer: int) -> RecurrentState:
        return RWKVState()


# ---------------------------------------------------------------------- RetNet


class GLU(nn.Module):
    """``fc2(act(fc1(x)) * gate(x))``: RetNet's feed-forward (Shazeer, 2020)."""

    def __init__(self, *, embed_dim: int, hidden_dim: int, activation: str) -> None:
        super().__init__()
        self.fc1 = make_linear(embed_dim, hidden_dim, bias=False)
        self.gate = make_linear(embed_dim, hidden_dim, bias=False)
        self.fc2 = make_linear(hidden_dim, embed_dim, bias=False)
        self.act = F.gelu if activation == "gelu" else F.silu

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)) * self.gate(x))


class RetNetBlock(nn.Module):
    """``x + MSR(RMSNorm(x))``, then ``x + GLU(RMSNorm(x))``."""

    def __init__(self, config: RetNetConfig) -> None:
        super().__init__()
        d = config.hidden_size
        assert config.value_dim is not None and config.intermediate_size is not None
        self.retention_layer_norm = RMSNorm(d, eps=config.norm_eps)
        self.retention = MultiScaleRetention(
            embed_dim=d,
            value_dim=config.value_dim,
            num_heads=config.num_heads,
            norm_eps=config.norm_eps,
            form=config.form,
            chunk_size=config.chunk_size,
        )
        self.final_layer_norm = RMSNorm(d, eps=config.norm_eps)
        self.ffn = GLU(
            embed_dim=d, hidden_dim=config.intermediate_size, activation=config.hidden_act
        )

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None,
        positions: Tensor,
        state: RetentionState | None = None,
    ) -> Tensor:
        x = x + self.retention(
            self.retention_layer_norm(x), positions=positions, mask=mask, state=state
        )
        return x + self.ffn(self.final_layer_norm(x))


class RetNetLM(RecurrentLM):
    """RetNet language model (Sun et al., 2023), shaped as torchscale's ``RetNetDecoder``.

    Args:
        config: the architecture.
    """

    def __init__(self, config: RetNetConfig) -> None:
        super().__init__()
        if not isinstance(config, RetNetConfig):
            raise TypeError(f"config must be a RetNetConfig, got {type(config).__name__}")
        self.config = config
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.embed_scale = d**0.5 if config.scale_embedding else 1.0
        self.layers = nn.ModuleList(RetNetBlock(config) for _ in range(config.num_hidden_layers))
        self.norm_f = RMSNorm(d, eps=config.norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings else make_linear(d, config.vocab_size, bias=False)
        )

    def _embed(self, x: Tensor) -> Tensor:
        return x * self.embed_scale

    def _new_state(self, layer: int) -> RecurrentState:
        return RetentionState()
