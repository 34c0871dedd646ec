"""A BERT-style encoder built from :class:`~attnlab.models.config.EncoderConfig`.

Shape notation: ``B`` batch, ``S`` sequence, ``D`` hidden size, ``H`` heads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from attnlab.functional._checks import check_binary_mask
from attnlab.functional.attention import AttnMask
from attnlab.functional.masks import (
    MaskPattern,
    document,
    full,
    padding,
    padding_mask,
    sliding_window,
)
from attnlab.functional.score_mods import ScoreMod, symmetric_alibi
from attnlab.models._checkpoint import call_layer, checkpointing
from attnlab.models.config import EncoderConfig
from attnlab.models.outputs import EncoderOutput
from attnlab.modules.attention import MultiHeadAttention
from attnlab.modules.embeddings import Embeddings
from attnlab.modules.encoder_layer import EncoderLayer
from attnlab.modules.linear import make_linear
from attnlab.modules.longformer_attention import LongformerSelfAttention
from attnlab.modules.mlp import FeedForward, GatedFeedForward
from attnlab.modules.positions import RotaryEmbedding

if TYPE_CHECKING:
    from attnlab.models.embedding import EncodeReport, SentenceSettings

__all__ = ["EncoderModel", "Pooler", "build_encoder_layer", "local_masks"]


def local_masks(
    config: EncoderConfig, mask: AttnMask, attention_mask: Tensor | None
) -> list[AttnMask]:
    """Each layer's mask: ``mask`` on global layers; on local ones (``local_attention``)
    the pattern ``sliding_window(W // 2, W // 2)`` with ``mask``'s padding or documents."""
    windows = config.local_attention or (None,) * config.num_hidden_layers
    out: list[AttnMask] = []
    for w in windows:
        if w is None:
            out.append(mask)
            continue
        local: MaskPattern = sliding_window(w // 2, w // 2)
        if isinstance(mask, MaskPattern):
            local = local & mask
        elif mask is not None:  # a dense padding mask [B, 1, 1, S] from attention_mask
            assert attention_mask is not None
            local = local & padding(attention_mask)
        out.append(local)
    return out


class Pooler(nn.Module):
    """BERT's pooler: ``tanh(dense(h[:, 0]))``."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.dense = make_linear(hidden_size, hidden_size)

    def forward(self, hidden: Tensor) -> Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))  # [B, D]


def build_encoder_layer(
    config: EncoderConfig,
    *,
    layer: int = 0,
    backend: str = "auto",
    rotary: nn.Module | None = None,
    score_mod: ScoreMod | None = None,
) -> EncoderLayer:
    """Layer ``layer`` of the encoder ``config`` describes.

    Its attention is :class:`MultiHeadAttention` (full attention), or Longformer's
    :class:`LongformerSelfAttention` when ``config.attention_window`` is set; ``rotary`` is
    the model's shared RoPE module when ``position_embedding_type == "rope"``, and
    ``score_mod`` Longformer's ALiBi modifier when it is ``"alibi"`` (full-attention layers
    get theirs on the model's mask pattern).
    """
    d = config.hidden_size
    window = config.layer_window(layer)
    attention: nn.Module
    if window is not None:
        attention = LongformerSelfAttention(
            embed_dim=d,
            num_heads=config.num_attention_heads,
            window=window,
            dropout=config.attention_probs_dropout_prob,
            backend=backend,
            rotary=rotary,
            score_mod=score_mod,
        )
    else:
        attention = MultiHeadAttention(
            embed_dim=d,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            dropout=config.attention_probs_dropout_prob,
            backend=backend,
            rotary=rotary,
            bias=config.attention_bias,
        )
    ffn = GatedFeedForward if config.mlp == "gated" else FeedForward
    norm_first = config.first_attn_norm or layer > 0
    return EncoderLayer(
        attention=attention,
        feed_forward=ffn(
            embed_dim=d,
            hidden_dim=config.intermediate_size,
            activation=config.hidden_act,
            dropout=config.hidden_dropout_prob,
            bias=config.mlp_bias,
        ),
        attn_norm=(
            nn.LayerNorm(d, eps=config.layer_norm_eps, bias=config.norm_bias)
            if norm_first
            else nn.Identity()
        ),
        ffn_norm=nn.LayerNorm(d, eps=config.layer_norm_eps, bias=config.norm_bias),
        norm_position="pre" if config.norm_position == "pre" else "post",
        dropout=config.hidden_dropout_prob,
    )


class EncoderModel(nn.Module):
    """Embeddings, a stack of encoder layers and an optional pooler (Devlin et al., 2019).

    Args:
        config: the architecture.
        backend: attention backend for every layer (``"auto"`` by default).
    """

    def __init__(self, config: EncoderConfig, *, backend: str = "auto") -> None:
        super().__init__()
        if not isinstance(config, EncoderConfig):
            raise TypeError(f"config must be an EncoderConfig, got {type(config).__name__}")
        self.config = config
        learned = config.position_embedding_type in ("absolute", "roberta")
        self.embeddings = Embeddings(
            vocab_size=config.vocab_size,
            embed_dim=config.hidden_size,
            max_positions=config.max_position_embeddings if learned else 0,
            type_vocab_size=config.type_vocab_size,
            layer_norm_eps=config.layer_norm_eps,
            dropout=config.hidden_dropout_prob,
            pad_token_id=config.pad_token_id,
            norm_bias=config.norm_bias,
        )
        self.rotary = (
            RotaryEmbedding(
                dim=config.head_dim,
                base=config.rope_theta,
                max_position_embeddings=config.max_position_embeddings,
            )
            if config.position_embedding_type == "rope"
            else None
        )
        #: two-sided ALiBi (a score modifier) when ``position_embedding_type == "alibi"``
        self.alibi = (
            symmetric_alibi(config.num_attention_heads)
            if config.position_embedding_type == "alibi"
            else None
        )
        windows = config.local_attention or (None,) * config.num_hidden_layers
        #: the local layers' RoPE (ModernBERT: a base of their own), or the model's
        self.local_rotary = self.rotary
        if self.rotary is not None and config.local_rope_theta is not None:
            self.local_rotary = RotaryEmbedding(
                dim=config.head_dim,
                base=config.local_rope_theta,
                max_position_embeddings=config.max_position_embeddings,
            )
        self.layers = nn.ModuleList(
            build_encoder_layer(
                config,
                layer=i,
                backend=backend,
                rotary=self.rotary if windows[i] is None else self.local_rotary,
                score_mod=self.alibi,
            )
            for i in range(config.num_hidden_layers)
        )
        self.final_norm = (
            nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=config.norm_bias)
            if config.norm_position == "pre"
            else None
        )
        self.pooler = Pooler(config.hidden_size) if config.add_pooler else None
        #: Pooling, normalisation and max length for :meth:`encode` (set by ``from_hf`` on a
        #: sentence-transformers folder), and the tokenizer it uses for texts.
        self.sentence_settings: SentenceSettings | None = None
        self.tokenizer: Any = None

    def encode(
        self,
        inputs: str | Sequence[str] | Sequence[Sequence[int]] | Tensor,
        *,
        tokenizer: Any = None,
        settings: SentenceSettings | None = None,
        batch_size: int = 32,
        strategy: str = "auto",
        dtype: torch.dtype = torch.float32,
        normalize: bool | None = None,
        show_progress_bar: bool | None = None,
        return_report: bool = False,
    ) -> Tensor | tuple[Tensor, EncodeReport]:
        """Sentence embeddings, as sentence-transformers' ``encode`` computes them.

        Texts are tokenized and truncated at ``max_seq_length`` (from the model folder's
        ``sentence_bert_config.json``), run packed (many texts per row, a ``document``
        pattern, positions restarting per text: no compute on padding) or padded in
        length-sorted batches, whichever the cost model estimates cheaper, then pooled
        (mean, CLS, max: the folder's ``1_Pooling/config.json``) and normalised when the
        folder's ``modules.json`` says so (Reimers & Gurevych, 2019).

        Args:
            inputs: a text, a list of texts, or a list of token-id lists ([CLS]/[SEP]
                included) or an ``(N, S)`` id tensor without padding.
            tokenizer: a ``tokenizers.Tokenizer`` or transformers fast tokenizer; default
                the one ``from_hf`` loaded with the model.
            settings: pooling, normalisation, max length; default the model folder's
                (mean pooling when the folder has none, logged).
            batch_size: texts per forward (padded), or their tokens' worth (packed).
            strategy: ``"auto"`` (cost model), ``"packed"`` or ``"padded"``.
            dtype: ``torch.float32`` or ``torch.bfloat16`` (autocast; pooling in float32).
            normalize: override the settings' L2 normalisation.
            show_progress_bar: a bar on stderr; default when stderr is a terminal and there
                are more than 8 forwards.
            return_report: also return an :class:`~attnlab.models.embedding.EncodeReport`
                (strategy and why, truncated texts, pooling, attention backend).

        Returns:
            ``[N, D']`` float32 embeddings (``[D']`` for a single text), ``D'`` = ``D`` times
            the number of pooling modes; with ``return_report``, ``(embeddings, report)``.

        Raises:
            TypeError: items that are neither all strings nor all token-id lists.
            ValueError: texts without a tokenizer, bad ``batch_size``/``strategy``/``dtype``,
                token-id lists that are empty, too long or out of the vocabulary.
        """
        from attnlab.models.embedding import encode

        return encode(
            self,
            inputs,
            tokenizer=tokenizer,
            settings=settings,
            batch_size=batch_size,
            strategy=strategy,
            dtype=dtype,
            normalize=normalize,
            show_progress_bar=show_progress_bar,
            return_report=return_report,
        )

    def num_parameters(self) -> int:
        """Number of parameters (weights, not buffers)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        *,
        global_attention_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
        unpad: bool = False,
    ) -> EncoderOutput:
        """Encode a batch.

        Args:
            input_ids: ``[B, S]`` token ids (or ``inputs_embeds [B, S, D]``).
            attention_mask: ``[B, S]`` of 1 (token) / 0 (padding).
            token_type_ids: ``[B, S]`` segment ids (default 0).
            position_ids: ``[B, S]`` or ``[S]`` positions (default ``0..S-1``).
            inputs_embeds: ``[B, S, D]`` instead of ``input_ids``.
            output_attentions: return each layer's weights ``[B, H, S, S]``.
            output_hidden_states: return the embeddings and every layer's output.
            global_attention_mask: ``[B, S]`` of 1 at Longformer's global tokens (they attend
                to every token and every token attends to them), 0 elsewhere; only for a
                config with ``attention_window``.
            document_ids: ``[B, S]`` packed rows: the sequence each slot belongs to
                (``0, 1, ...`` within a row, ``-1`` for an empty slot); a token attends only
                to its own sequence (a ``document`` pattern). Pass ``position_ids`` that
                restart per sequence. Not with ``attention_mask``.
            unpad: compute only the real tokens of a padded batch: they are packed into
                rows (:mod:`attnlab.models.packing`) and the states scattered back, so the
                real tokens' states are those of the padded run and padding positions hold
                zeros. Needs ``input_ids`` and ``attention_mask``.

        Returns:
            :class:`EncoderOutput`.

        Raises:
            ValueError: shapes that do not fit, ``document_ids`` with ``attention_mask``,
                ``unpad`` without ``input_ids``/``attention_mask`` or with
                ``output_attentions``.
        """
        if unpad:
            if output_attentions or document_ids is not None:
                raise ValueError(
                    "unpad=True packs rows itself: it takes no document_ids and returns no "
                    "attentions (output_attentions=False)"
                )
            return self._forward_unpadded(
                input_ids, attention_mask, token_type_ids, position_ids, output_hidden_states
            )
        if position_ids is None and self.config.position_embedding_type == "roberta":
            position_ids = self._roberta_positions(input_ids, inputs_embeds)
        x = self.embeddings(
            input_ids=input_ids,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
        )  # [B, S, D]
        b, s = x.shape[:2]
        layer_kwargs: dict[str, Any] = {}
        if self.rotary is not None:
            layer_kwargs["positions"] = (
                torch.arange(s, device=x.device) if position_ids is None else position_ids
            )
        if self.config.attention_window is not None:
            return self._forward_longformer(
                x,
                attention_mask,
                global_attention_mask,
                layer_kwargs,
                output_attentions,
                output_hidden_states,
                document_ids,
            )
        if global_attention_mask is not None:
            raise ValueError(
                "global_attention_mask is for Longformer encoders (a config with attention_window)"
            )
        mask = self._mask(attention_mask, document_ids, b, s)
        layers = [
            {"attn_mask": m, "need_weights": output_attentions, **layer_kwargs}
            for m in local_masks(self.config, mask, attention_mask)
        ]
        return self._run_layers(x, layers, output_attentions, output_hidden_states)

    def _mask(
        self, attention_mask: Tensor | None, document_ids: Tensor | None, b: int, s: int
    ) -> AttnMask:
        """The layers' mask: a ``document`` pattern, padding, or None; ALiBi as its scores."""
        mask: AttnMask = None
        if document_ids is not None:
            if attention_mask is not None:
                raise ValueError(
                    "pass document_ids or attention_mask, not both (empty slots are document -1)"
                )
            if not isinstance(document_ids, Tensor) or tuple(document_ids.shape) != (b, s):
                got = (
                    tuple(document_ids.shape)
                    if isinstance(document_ids, Tensor)
                    else type(document_ids).__name__
                )
                raise ValueError(f"document_ids must be (batch, seq_len) = {(b, s)}, got {got}")
            mask = document(document_ids)
        elif attention_mask is not None:
            check_binary_mask("attention_mask", attention_mask, (b, s))
            pad = padding_mask(attention_mask)  # [B, 1, 1, S]
            # An all-ones mask changes nothing; dropping it lets fused kernels skip masking.
            mask = None if bool(pad.all()) else pad
        if self.alibi is not None:
            if isinstance(mask, Tensor):  # a padding mask [B, 1, 1, S] from attention_mask
                assert attention_mask is not None
                mask = padding(attention_mask)
            mask = (full() if mask is None else mask).with_scores(self.alibi)
        return mask

    def _run_layers(
        self,
        x: Tensor,
        layer_kwargs: list[dict[str, Any]],
        output_attentions: bool,
        output_hidden_states: bool,
    ) -> EncoderOutput:
        """Every layer with its own keywords, then the final norm and the pooler."""
        hidden: list[Tensor] = [x] if output_hidden_states else []
        attentions: list[Tensor] = []
        ckpt = checkpointing(self)
        for layer, kwargs in zip(self.layers, layer_kwargs):
            x, w = call_layer(layer, ckpt, x, **kwargs)
            if output_attentions:
                assert w is not None
                attentions.append(w)
            if output_hidden_states:
                hidden.append(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
            if output_hidden_states:
                hidden[-1] = x
        return EncoderOutput(
            last_hidden_state=x,
            pooler_output=self.pooler(x) if self.pooler is not None else None,
            hidden_states=tuple(hidden) if output_hidden_states else None,
            attentions=tuple(attentions) if output_attentions else None,
        )

    @property
    def first_position(self) -> int:
        """The position id of a sequence's first token: ``pad_token_id + 1`` for RoBERTa's
        positions, else 0 (packed rows restart each sequence there)."""
        if self.config.position_embedding_type == "roberta":
            assert self.config.pad_token_id is not None
            return self.config.pad_token_id + 1
        return 0

    def _roberta_positions(self, input_ids: Tensor | None, inputs_embeds: Tensor | None) -> Tensor:
        """RoBERTa's positions: real tokens count from ``pad + 1``, padding tokens sit at ``pad``."""
        pad = self.config.pad_token_id
        assert pad is not None  # the config checks it
        if input_ids is None:
            assert inputs_embeds is not None
            s = inputs_embeds.shape[1]
            return torch.arange(pad + 1, pad + 1 + s, device=inputs_embeds.device).unsqueeze(0)
        real = (input_ids != pad).long()
        return torch.cumsum(real, dim=1) * real + pad  # [B, S]

    def _forward_longformer(
        self,
        x: Tensor,
        attention_mask: Tensor | None,
        global_attention_mask: Tensor | None,
        layer_kwargs: dict[str, Any],
        output_attentions: bool,
        output_hidden_states: bool,
        document_ids: Tensor | None,
    ) -> EncoderOutput:
        """Every layer: a sliding window plus global tokens (Beltagy et al., 2020)."""
        b, s = x.shape[:2]
        if output_attentions or document_ids is not None:
            raise ValueError(
                "a Longformer encoder (attention_window) returns no attention weights and takes "
                "no document_ids"
            )
        key_mask: Tensor | None = None
        if attention_mask is not None:
            if not isinstance(attention_mask, Tensor) or tuple(attention_mask.shape) != (b, s):
                got = getattr(attention_mask, "shape", attention_mask)
                raise ValueError(f"attention_mask must be (batch, seq_len) = {(b, s)}, got {got}")
            keep = padding_mask(attention_mask)[:, 0, 0, :]  # [B, S]
            key_mask = None if bool(keep.all()) else keep
        global_mask: Tensor | None = None
        if global_attention_mask is not None:
            if not isinstance(global_attention_mask, Tensor) or tuple(
                global_attention_mask.shape
            ) != (b, s):
                got = getattr(global_attention_mask, "shape", global_attention_mask)
                raise ValueError(
                    f"global_attention_mask must be (batch, seq_len) = {(b, s)}, got {got}"
                )
            global_mask = padding_mask(global_attention_mask)[:, 0, 0, :]  # [B, S]
            if key_mask is not None:
                global_mask = global_mask & key_mask  # padding is never global
        kwargs = {"global_mask": global_mask, "key_mask": key_mask, **layer_kwargs}
        return self._run_layers(x, [kwargs] * len(self.layers), False, output_hidden_states)

    def _forward_unpadded(
        self,
        input_ids: Tensor | None,
        attention_mask: Tensor | None,
        token_type_ids: Tensor | None,
        position_ids: Tensor | None,
        output_hidden_states: bool,
    ) -> EncoderOutput:
        from attnlab.models.packing import forward_unpadded

        return forward_unpadded(
            self, input_ids, attention_mask, token_type_ids, position_ids, output_hidden_states
        )
