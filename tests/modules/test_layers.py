"""FeedForward, Embeddings and EncoderLayer against their formulas."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.modules import Embeddings, EncoderLayer, FeedForward, MultiHeadAttention


def test_feed_forward_formula() -> None:
    ff = FeedForward(embed_dim=8, hidden_dim=32).eval()
    x = torch.randn(2, 3, 8)
    want = F.linear(
        F.gelu(F.linear(x, ff.fc_in.weight, ff.fc_in.bias)), ff.fc_out.weight, ff.fc_out.bias
    )
    torch.testing.assert_close(ff(x), want)


def test_embeddings_formula_and_defaults() -> None:
    emb = Embeddings(vocab_size=20, embed_dim=8, max_positions=10, type_vocab_size=2).eval()
    ids = torch.tensor([[3, 4, 5]])
    tt = torch.tensor([[0, 1, 1]])
    want = (
        emb.word_embeddings(ids)
        + emb.position_embeddings(torch.arange(3))
        + emb.token_type_embeddings(tt)
    )
    torch.testing.assert_close(emb(ids, token_type_ids=tt), emb.norm(want))
    # default token types are 0 and default positions count from 0
    torch.testing.assert_close(
        emb(ids), emb(ids, token_type_ids=torch.zeros_like(ids), position_ids=torch.arange(3))
    )


def _layer(norm_position: str) -> EncoderLayer:
    return EncoderLayer(
        attention=MultiHeadAttention(embed_dim=8, num_heads=2),
        feed_forward=FeedForward(embed_dim=8, hidden_dim=16),
        attn_norm=nn.LayerNorm(8),
        ffn_norm=nn.LayerNorm(8),
        norm_position=norm_position,  # type: ignore[arg-type]
    ).eval()


def test_post_ln_layer_formula() -> None:
    layer = _layer("post")
    x = torch.randn(2, 4, 8)
    h = layer.attn_norm(x + layer.attention(x)[0])
    want = layer.ffn_norm(h + layer.feed_forward(h))
    torch.testing.assert_close(layer(x)[0], want)


def test_pre_ln_layer_formula() -> None:
    layer = _layer("pre")
    x = torch.randn(2, 4, 8)
    h = x + layer.attention(layer.attn_norm(x))[0]
    want = h + layer.feed_forward(layer.ffn_norm(h))
    torch.testing.assert_close(layer(x)[0], want)
