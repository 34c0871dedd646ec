"""A BERT-style encoder built from :class:`~attnlab.models.config.EncoderConfig`.

Shape notation: ``B`` batch, ``S`` sequence, ``D`` hidden size, ``H`` heads.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnlab.functional._checks import check_binary_mask
from attnlab.functional.masks import padding_mask
from attnlab.models._checkpoint import call_layer, checkpointing
from attnlab.models.config import EncoderConfig
from attnlab.models.outputs import EncoderOutput
from attnlab.modules.attention import MultiHeadAttention
from attnlab.modules.embeddings import Embeddings
from attnlab.modules.encoder_layer import EncoderLayer
from attnlab.modules.mlp import FeedForward

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

        Returns:
            :class:`EncoderOutput`.
        """
        x = self.embeddings(
            input_ids=input_ids,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
        )  # [B, S, D]
        mask: Tensor | None = None
        if attention_mask is not None:
            b, s = x.shape[:2]
            check_binary_mask("attention_mask", attention_mask, (b, s))
            pad = padding_mask(attention_mask)  # [B, 1, 1, S]
            # An all-ones mask changes nothing; dropping it lets fused kernels skip masking.
            mask = None if bool(pad.all()) else pad
        hidden: list[Tensor] = [x] if output_hidden_states else []
        attentions: list[Tensor] = []
        ckpt = checkpointing(self)
        for layer in self.layers:
            x, w = call_layer(layer, ckpt, x, attn_mask=mask, need_weights=output_attentions)
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
