"""Packed rows (``document_ids``) and ``unpad=True`` give each sequence its padded-run states."""

from __future__ import annotations

import pytest
import torch

from attnlab.models import EncoderConfig, EncoderModel
from attnlab.models.packing import bucket_batches, make_packed, pack_rows


def _model() -> EncoderModel:
    cfg = EncoderConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=40, max_position_embeddings=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return EncoderModel(cfg).eval()


def test_pack_rows_fits_every_sequence_once() -> None:
    lengths = [5, 9, 3, 16, 1, 7, 7, 12]
    rows = pack_rows(lengths, 16)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= 16 for r in rows)
    assert len(rows) == 4  # 60 tokens: ceil(60 / 16) = 4 rows, reached
    with pytest.raises(ValueError, match=r"lengths must be in 1..16"):
        pack_rows([17], 16)
    assert bucket_batches([3, 9, 5], 2) == [[1, 2], [0]]


def test_packed_rows_equal_separate_runs() -> None:
    model = _model()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, 50, (n,), generator=g).tolist() for n in (7, 3, 12, 5, 1)]
    rows = pack_rows([len(s) for s in seqs], 16)
    batch = make_packed(seqs, rows, row_len=16)
    with torch.no_grad():
        out = model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            document_ids=batch.document_ids,
        ).last_hidden_state.reshape(-1, 32)
        for k, i in enumerate(batch.order):
            alone = model(input_ids=torch.tensor([seqs[i]])).last_hidden_state[0]
            torch.testing.assert_close(out[batch.segments == k], alone, atol=1e-5, rtol=0)


def test_unpad_equals_padded_on_real_tokens() -> None:
    model = _model()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 50, (4, 10), generator=g)
    mask = torch.tensor([[1] * 10, [1] * 6 + [0] * 4, [1] * 2 + [0] * 8, [1] * 9 + [0]])
    types = torch.randint(0, 2, (4, 10), generator=g)
    with torch.no_grad():
        want = model(
            input_ids=ids, attention_mask=mask, token_type_ids=types, output_hidden_states=True
        )
        got = model(
            input_ids=ids,
            attention_mask=mask,
            token_type_ids=types,
            unpad=True,
            output_hidden_states=True,
        )
    real = mask.bool()
    torch.testing.assert_close(
        got.last_hidden_state[real], want.last_hidden_state[real], atol=1e-5, rtol=0
    )
    assert bool((got.last_hidden_state[~real] == 0).all())
    assert got.hidden_states is not None and len(got.hidden_states) == 3
    with pytest.raises(ValueError, match="needs input_ids and attention_mask"):
        model(input_ids=ids, unpad=True)
    with pytest.raises(ValueError, match="no document_ids"):
        model(input_ids=ids, attention_mask=mask, unpad=True, output_attentions=True)
    with pytest.raises(ValueError, match="not both"):
        model(input_ids=ids, attention_mask=mask, document_ids=torch.zeros_like(ids))
    with pytest.raises(ValueError, match=r"document_ids must be \(batch, seq_len\)"):
        model(input_ids=ids, document_ids=torch.zeros(4, 3, dtype=torch.long))


@pytest.mark.parametrize("kind", ["rope", "alibi"])
def test_relative_position_encoders_pack_exactly(kind: str) -> None:
    cfg = EncoderConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=40, max_position_embeddings=64, position_embedding_type=kind,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = EncoderModel(cfg).eval()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 50, (3, 9), generator=g)
    mask = torch.tensor([[1] * 9, [1] * 4 + [0] * 5, [1] * 7 + [0] * 2])
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask).last_hidden_state
        packed = model(input_ids=ids, attention_mask=mask, unpad=True).last_hidden_state
        alone = model(input_ids=ids[1:2, :4]).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(packed[real], padded[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(padded[1, :4], alone[0], atol=1e-5, rtol=0)
