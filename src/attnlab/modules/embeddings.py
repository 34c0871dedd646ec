"""BERT-style input embeddings: token + learned absolute position + token type.

Shape notation: ``B`` batch, ``S`` sequence, ``D`` model width.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnlab.functional._checks import check_index_range, check_integer_tensor, check_tensor

__all__ = ["Embeddings"]


class Embeddings(nn.Module):
    """``dropout(LayerNorm(tok[ids] + pos[position_ids] + type[token_type_ids]))`` (Devlin et al., 2019).

    Args:
        vocab_size: number of token ids.
        embed_dim: model width ``D``.
        max_positions: number of learned positions (sequence length limit); 0 for none
            (positions then come from the attention: RoPE, ALiBi).
        type_vocab_size: number of token types (segments); 0 disables them.
        layer_norm_eps: LayerNorm epsilon.
        dropout: dropout after the LayerNorm (training only).
        pad_token_id: index whose embedding gets no gradient (``padding_idx``), or None.
        norm_bias: a bias in the LayerNorm.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        embed_dim: int,
        max_positions: int,
        type_vocab_size: int = 2,
        layer_norm_eps: float = 1e-12,
        dropout: float = 0.0,
        pad_token_id: int | None = None,
        norm_bias: bool = True,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self.type_vocab_size = type_vocab_size
        self.word_embeddings = nn.Embedding(vocab_size, embed_dim, padding_idx=pad_token_id)
        self.position_embeddings = (
            nn.Embedding(max_positions, embed_dim) if max_positions > 0 else None
        )
        self.token_type_embeddings = (
            nn.Embedding(type_vocab_size, embed_dim) if type_vocab_size > 0 else None
        )
        self.norm = nn.LayerNorm(embed_dim, eps=layer_norm_eps, bias=norm_bias)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self,
        input_ids: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
    ) -> Tensor:
        """Embed ``input_ids [B, S]`` (or add positions to ``inputs_embeds [B, S, D]``).

        Raises:
            ValueError: both or neither of ``input_ids``/``inputs_embeds``, shapes that
                differ, a sequence longer than ``max_positions``, ids out of range.
            TypeError: non-integer ids.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if input_ids is not None:
            ids = _check_ids("input_ids", input_ids, self.vocab_size)
            shape = tuple(ids.shape)
            device = ids.device
        else:
            assert inputs_embeds is not None
            check_tensor("inputs_embeds", inputs_embeds)
            if inputs_embeds.dim() != 3:
                raise ValueError(
                    f"inputs_embeds must be (batch, seq_len, dim), got {tuple(inputs_embeds.shape)}"
                )
            shape = tuple(inputs_embeds.shape[:2])
            device = inputs_embeds.device
        if 0 in shape:
            name = "input_ids" if input_ids is not None else "inputs_embeds"
            raise ValueError(
                f"{name} holds no tokens (batch, seq_len = {shape}); a model needs at least one "
                "token per row"
            )
        seq_len = shape[1]
        x = inputs_embeds if inputs_embeds is not None else self.word_embeddings(input_ids)
        if self.position_embeddings is None:
            pass
        elif position_ids is None:
            if seq_len > self.max_positions:
                raise ValueError(
                    f"sequence length {seq_len} exceeds max_position_embeddings "
                    f"({self.max_positions})"
                )
            position_ids = torch.arange(seq_len, device=device).unsqueeze(0)  # [1, S]
            x = x + self.position_embeddings(position_ids)
        else:
            position_ids = _check_ids("position_ids", position_ids, self.max_positions, shape)
            x = x + self.position_embeddings(position_ids)
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros(shape, dtype=torch.long, device=device)
            else:
                token_type_ids = _check_ids(
                    "token_type_ids", token_type_ids, self.type_vocab_size, shape
                )
            x = x + self.token_type_embeddings(token_type_ids)
        elif token_type_ids is not None:
            raise ValueError("token_type_ids given, but the model has type_vocab_size=0")
        return self.dropout(self.norm(x))  # [B, S, D]


def _check_ids(name: str, ids: Tensor, upper: int, shape: tuple[int, ...] | None = None) -> Tensor:
    check_integer_tensor(name, ids)
    if shape is None:
        if ids.dim() != 2:
            raise ValueError(f"{name} must be (batch, seq_len), got shape {tuple(ids.shape)}")
    else:
        if ids.dim() == 1 and ids.shape[0] == shape[1]:
            ids = ids.unsqueeze(0)
        try:
            ok = torch.broadcast_shapes(tuple(ids.shape), shape) == torch.Size(shape)
        except RuntimeError:
            ok = False
        if ids.dim() != 2 or not ok:
            raise ValueError(f"{name} has shape {tuple(ids.shape)}, expected {shape}")
    return check_index_range(name, ids, upper)
