"""Bad input gets a ValueError/TypeError that names the values, at every public entry point."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from attnlab import scaled_dot_product_attention as sdpa
from attnlab.functional import masks
from attnlab.models import EncoderConfig, EncoderModel
from attnlab.modules import Embeddings, FeedForward, MultiHeadAttention

q4 = torch.randn(1, 4, 5, 8)
kv2 = torch.randn(1, 2, 5, 8)
tiny = EncoderConfig(
    vocab_size=50,
    hidden_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    intermediate_size=32,
    max_position_embeddings=8,
)

CASES: list[tuple[str, type[Exception], str, Callable[[], object]]] = [
    ("query not a tensor", TypeError, "query must be a torch.Tensor", lambda: sdpa([1.0], q4, q4)),
    ("integer dtype", TypeError, "torch.int64", lambda: sdpa(q4.long(), q4.long(), q4.long())),
    ("mixed dtypes", TypeError, "torch.float64", lambda: sdpa(q4, q4.double(), q4)),
    ("rank 2", ValueError, r"\(5, 8\)", lambda: sdpa(q4[0, 0], q4[0, 0], q4[0, 0])),
    ("head dim mismatch", ValueError, "E=8.*E=4", lambda: sdpa(q4, q4[..., :4], q4)),
    ("key/value length", ValueError, "same length", lambda: sdpa(q4, q4, q4[:, :, :3])),
    ("heads without gqa", ValueError, "4 heads.*enable_gqa", lambda: sdpa(q4, kv2, kv2)),
    (
        "heads not divisible",
        ValueError,
        r"query heads \(4\).*\(3\)",
        lambda: sdpa(q4, torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5, 8), enable_gqa=True),
    ),
    (
        "mask shape",
        ValueError,
        r"\(5, 4\) does not broadcast.*\(1, 4, 5, 5\)",
        lambda: sdpa(q4, q4, q4, torch.ones(5, 4, dtype=torch.bool)),
    ),
    (
        "integer mask",
        TypeError,
        "torch.int64.*padding_mask",
        lambda: sdpa(q4, q4, q4, torch.ones(5, 5).long()),
    ),
    ("dropout", ValueError, "dropout_p.*1.5", lambda: sdpa(q4, q4, q4, dropout_p=1.5)),
    ("scale", ValueError, "scale.*-1", lambda: sdpa(q4, q4, q4, scale=-1.0)),
    (
        "embed_dim/num_heads",
        ValueError,
        r"embed_dim \(10\).*num_heads \(4\)",
        lambda: MultiHeadAttention(embed_dim=10, num_heads=4),
    ),
    (
        "heads/kv heads",
        ValueError,
        r"num_heads \(8\).*num_kv_heads \(3\)",
        lambda: MultiHeadAttention(embed_dim=16, num_heads=8, num_kv_heads=3),
    ),
    (
        "module input width",
        ValueError,
        "width 12, expected embed_dim=16",
        lambda: MultiHeadAttention(embed_dim=16, num_heads=2)(torch.randn(1, 3, 12)),
    ),
    (
        "module padding shape",
        ValueError,
        r"\(1, 3\), got \(1, 4\)",
        lambda: MultiHeadAttention(embed_dim=16, num_heads=2)(
            torch.randn(1, 3, 16), attention_mask=torch.ones(1, 4)
        ),
    ),
    (
        "attention_mask values",
        ValueError,
        r"1 \(token\) and 0 \(padding\), found \[2\]",
        lambda: masks.padding_mask(torch.tensor([[1, 2]])),
    ),
    (
        "config heads",
        ValueError,
        r"hidden_size \(16\).*num_attention_heads \(3\)",
        lambda: EncoderConfig(hidden_size=16, num_attention_heads=3),
    ),
    (
        "config activation",
        ValueError,
        "hidden_act 'gelux'",
        lambda: EncoderConfig(hidden_act="gelux"),
    ),
    (
        "config dropout",
        ValueError,
        "hidden_dropout_prob.*1.2",
        lambda: EncoderConfig(hidden_dropout_prob=1.2),
    ),
    (
        "sequence too long",
        ValueError,
        r"sequence length 9 exceeds max_position_embeddings \(8\)",
        lambda: EncoderModel(tiny)(torch.ones(1, 9, dtype=torch.long)),
    ),
    (
        "token id out of range",
        ValueError,
        r"input_ids must be in \[0, 50\), got values in \[0, 50\]",
        lambda: EncoderModel(tiny)(torch.tensor([[0, 50]])),
    ),
    (
        "float ids",
        TypeError,
        "input_ids must be an integer tensor, got torch.float32",
        lambda: EncoderModel(tiny)(torch.ones(1, 3)),
    ),
    (
        "model mask shape",
        ValueError,
        r"attention_mask must be \(batch, seq_len\) = \(1, 3\)",
        lambda: EncoderModel(tiny)(
            torch.ones(1, 3, dtype=torch.long), attention_mask=torch.ones(2, 3)
        ),
    ),
    (
        "position ids range",
        ValueError,
        r"position_ids must be in \[0, 8\)",
        lambda: Embeddings(vocab_size=5, embed_dim=4, max_positions=8)(
            torch.ones(1, 2, dtype=torch.long), position_ids=torch.tensor([[0, 8]])
        ),
    ),
    (
        "ff activation",
        ValueError,
        "unknown activation 'tanhh'",
        lambda: FeedForward(embed_dim=4, hidden_dim=8, activation="tanhh"),
    ),
    ("config type", TypeError, "EncoderConfig, got dict", lambda: EncoderModel({"hidden_size": 8})),  # type: ignore[arg-type]
    (
        "unknown config field",
        ValueError,
        r"unknown EncoderConfig fields \['hiden_size'\]",
        lambda: EncoderConfig.from_dict({"hiden_size": 8}),
    ),
    (
        "both ids and embeds",
        ValueError,
        "exactly one of input_ids and inputs_embeds",
        lambda: EncoderModel(tiny)(
            torch.ones(1, 2, dtype=torch.long), inputs_embeds=torch.randn(1, 2, 16)
        ),
    ),
    (
        "lengths over max_len",
        ValueError,
        r"length \(5\) exceeds max_len \(3\)",
        lambda: masks.lengths_mask([5], 3),
    ),
]


@pytest.mark.parametrize(("name", "exc", "match", "call"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_named(
    name: str, exc: type[Exception], match: str, call: Callable[[], object]
) -> None:
    with pytest.raises(exc, match=match):
        call()


def test_fully_masked_row_is_not_an_error_and_not_nan() -> None:
    out = sdpa(q4, q4, q4, torch.zeros(5, 5, dtype=torch.bool))
    assert torch.equal(out, torch.zeros_like(out))
