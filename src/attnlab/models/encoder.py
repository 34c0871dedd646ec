"""A BERT-style encoder built from :class:`~attnlab.models.config.EncoderConfig`.

Shape notation: ``B`` batch, ``S`` sequence, ``D`` hidden size, ``H`` heads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from attnlab.functional.attention import AttnMask
from attnlab.functional.masks import document, padding_mask
from attnlab.models.config import EncoderConfig
from attnlab.models.outputs import EncoderOutput
from attnlab.modules.attention import MultiHeadAttention
from attnlab.modules.embeddings import Embeddings
from attnlab.modules.encoder_layer import EncoderLayer
from attnlab.modules.mlp import FeedForward

if TYPE_CHECKING:
    from attnlab.models.embedding import EncodeReport, SentenceSettings

__all__ = ["EncoderModel", "Pooler", "build_encoder_layer"]


class Pooler(nn.Module):
    """BERT's pooler: ``tanh(dense(h[:, 0]))``."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden: Tensor) -> Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))  # [B, D]


def build_encoder_layer(config: EncoderConfig, *, backend: str = "auto") -> EncoderLayer:
    """One encoder layer as ``config`` describes it."""
    d = config.hidden_size
    return EncoderLayer(
        attention=MultiHeadAttention(
            embed_dim=d,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            dropout=config.attention_probs_dropout_prob,
            backend=backend,
        ),
        feed_forward=FeedForward(
            embed_dim=d,
            hidden_dim=config.intermediate_size,
            activation=config.hidden_act,
            dropout=config.hidden_dropout_prob,
        ),
        attn_norm=nn.LayerNorm(d, eps=config.layer_norm_eps),
        ffn_norm=nn.LayerNorm(d, eps=config.layer_norm_eps),
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
        self.embeddings = Embeddings(
            vocab_size=config.vocab_size,
            embed_dim=config.hidden_size,
            max_positions=config.max_position_embeddings,
            type_vocab_size=config.type_vocab_size,
            layer_norm_eps=config.layer_norm_eps,
            dropout=config.hidden_dropout_prob,
            pad_token_id=config.pad_token_id,
        )
        self.layers = nn.ModuleList(
            build_encoder_layer(config, backend=backend) for _ in range(config.num_hidden_layers)
        )
        self.final_norm = (
            nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
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
        x = self.embeddings(
            input_ids=input_ids,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
        )  # [B, S, D]
        mask: AttnMask = None
        if document_ids is not None:
            b, s = x.shape[:2]
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
            b, s = x.shape[:2]
            if not isinstance(attention_mask, Tensor) or tuple(attention_mask.shape) != (b, s):
                got = (
                    tuple(attention_mask.shape)
                    if isinstance(attention_mask, Tensor)
                    else attention_mask
                )
                raise ValueError(f"attention_mask must be (batch, seq_len) = {(b, s)}, got {got}")
            pad = padding_mask(attention_mask)  # [B, 1, 1, S]
            # An all-ones mask changes nothing; dropping it lets fused kernels skip masking.
            mask = None if bool(pad.all()) else pad
        hidden: list[Tensor] = [x] if output_hidden_states else []
        attentions: list[Tensor] = []
        for layer in self.layers:
            x, w = layer(x, attn_mask=mask, need_weights=output_attentions)
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

    def _forward_unpadded(
        self,
        input_ids: Tensor | None,
        attention_mask: Tensor | None,
        token_type_ids: Tensor | None,
        position_ids: Tensor | None,
        output_hidden_states: bool,
    ) -> EncoderOutput:
        from attnlab.models.packing import pack_rows

        if input_ids is None or attention_mask is None:
            raise ValueError("unpad=True needs input_ids and attention_mask")
        if tuple(attention_mask.shape) != tuple(input_ids.shape) or input_ids.dim() != 2:
            raise ValueError(
                f"attention_mask {tuple(attention_mask.shape)} must match input_ids "
                f"{tuple(input_ids.shape)}, both (batch, seq_len)"
            )
        b, s = input_ids.shape
        keep = padding_mask(attention_mask)[:, 0, 0, :]  # [B, S]
        cols = torch.arange(s, device=input_ids.device).expand(b, s)
        pos = cols if position_ids is None else position_ids.expand(b, s)
        types = None if token_type_ids is None else token_type_ids.expand(b, s)
        lengths = keep.sum(-1).tolist()
        present = [r for r in range(b) if lengths[r] > 0]
        rows = pack_rows([lengths[r] for r in present], s)
        n_rows = len(rows)
        ids_p = torch.zeros(n_rows, s, dtype=input_ids.dtype, device=input_ids.device)
        pos_p = torch.zeros_like(ids_p)
        types_p = torch.zeros_like(ids_p)
        doc_p = torch.full_like(ids_p, -1)
        src_flat: list[Tensor] = []  # flat index into [B * S] of each packed slot
        dst_flat: list[Tensor] = []  # flat index into [R * S]
        for r, members in enumerate(rows):
            start = 0
            for d, j in enumerate(members):
                row = present[j]
                where = keep[row].nonzero().flatten()  # [n]
                n = where.numel()
                ids_p[r, start : start + n] = input_ids[row, where]
                pos_p[r, start : start + n] = pos[row, where]
                if types is not None:
                    types_p[r, start : start + n] = types[row, where]
                doc_p[r, start : start + n] = d
                src_flat.append(row * s + where)
                dst_flat.append(r * s + start + torch.arange(n, device=where.device))
                start += n
        out = self.forward(
            input_ids=ids_p,
            token_type_ids=types_p if types is not None else None,
            position_ids=pos_p,
            output_hidden_states=output_hidden_states,
            document_ids=doc_p,
        )
        src = torch.cat(src_flat) if src_flat else cols.new_zeros(0)
        dst = torch.cat(dst_flat) if dst_flat else cols.new_zeros(0)

        def scatter(h: Tensor) -> Tensor:
            d = h.shape[-1]
            full = h.new_zeros(b * s, d)
            full[src] = h.reshape(-1, d)[dst]
            return full.view(b, s, d)  # [B, S, D]

        last = scatter(out.last_hidden_state)
        return EncoderOutput(
            last_hidden_state=last,
            pooler_output=self.pooler(last) if self.pooler is not None else None,
            hidden_states=(
                tuple(scatter(h) for h in out.hidden_states)
                if out.hidden_states is not None
                else None
            ),
        )
