"""Parity with transformers' ``LongformerModel`` (random weights, float32, <= 1e-4), round trips,
the sliding-window + global pattern against a dense recomputation, and memory that grows with
``n * w``.
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import backends
from attnlab.functional.masks import padding_mask
from attnlab.models import EncoderConfig, EncoderModel
from attnlab.modules.longformer_attention import longformer_pattern

transformers = pytest.importorskip("transformers")


def _hf(window: int | list[int] = 4, layers: int = 2) -> torch.nn.Module:
    cfg = transformers.LongformerConfig(
        vocab_size=60, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
        intermediate_size=40, max_position_embeddings=80, attention_window=window,
        pad_token_id=1, type_vocab_size=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LongformerModel(cfg).eval()


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 60, (3, 21), generator=g)
    am = torch.ones_like(ids)
    am[1, 15:] = 0
    am[2, 7:] = 0
    ids = ids.masked_fill(am == 0, 1)  # the pad token
    gm = torch.zeros_like(ids)
    gm[0, [0, 9, 20]] = 1  # several global tokens, one at the end
    gm[1, [0, 3]] = 1
    gm[2, 18] = 1  # global on a padding position: padding wins
    tt = torch.randint(0, 2, ids.shape, generator=g)
    return {
        "input_ids": ids,
        "attention_mask": am,
        "global_attention_mask": gm,
        "token_type_ids": tt,
    }


@pytest.mark.parametrize("window", [4, [4, 8]])
@pytest.mark.parametrize("backend", ["auto", "reference", "sparse"])
def test_matches_transformers_longformer(window: int | list[int], backend: str) -> None:
    hf = _hf(window)
    ours = attnlab.from_hf(hf)
    assert ours.config.position_embedding_type == "roberta"
    batch = _batch()
    with torch.no_grad():
        want = hf(**batch)
        with backends.use(backend):
            got = ours(**batch)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(
        got.last_hidden_state[real], want.last_hidden_state[real], atol=1e-4, rtol=0
    )
    # padding positions too: they follow transformers' semantics (zero attention output)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, atol=1e-4, rtol=0)
    torch.testing.assert_close(got.pooler_output, want.pooler_output, atol=1e-4, rtol=0)


def test_without_global_tokens_or_padding() -> None:
    hf = _hf(6)
    ours = attnlab.from_hf(hf)
    ids = torch.randint(3, 60, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(
            ours(input_ids=ids).last_hidden_state,
            hf(input_ids=ids).last_hidden_state,
            atol=1e-4,
            rtol=0,
        )


def test_round_trip_to_hf() -> None:
    hf = _hf([4, 8])
    ours = attnlab.from_hf(hf)
    back = attnlab.to_hf(ours)
    assert type(back).__name__ == "LongformerModel"
    assert list(back.config.attention_window) == [4, 8]
    batch = _batch()
    with torch.no_grad():
        torch.testing.assert_close(
            back(**batch).last_hidden_state, hf(**batch).last_hidden_state, atol=1e-6, rtol=0
        )


def test_folder_round_trip(tmp_path) -> None:
    hf = _hf()
    hf.save_pretrained(tmp_path)
    ours = attnlab.from_hf(tmp_path)
    batch = _batch()
    with torch.no_grad():
        torch.testing.assert_close(
            ours(**batch).last_hidden_state, hf(**batch).last_hidden_state, atol=1e-4, rtol=0
        )


def test_pattern_is_window_or_global_and_not_padding() -> None:
    am = torch.tensor([[1] * 9 + [0] * 3])
    gm = torch.zeros(1, 12, dtype=torch.long)
    gm[0, 5] = 1
    dense = longformer_pattern(2, gm, padding_mask(am)[:, 0, 0, :]).to_dense(12, 12)[0, 0]
    i = torch.arange(12)
    want = ((i[:, None] - i[None, :]).abs() <= 2) | (i[None, :] == 5)
    want = want & (i[None, :] < 9)
    assert torch.equal(dense, want)


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="even int"):
        EncoderConfig(attention_window=5)
    with pytest.raises(ValueError, match="2 entries for 3 layers"):
        EncoderConfig(num_hidden_layers=3, attention_window=(2, 4))
    with pytest.raises(ValueError, match="position_embedding_type must be one of"):
        EncoderConfig(position_embedding_type="sinusoidal")
    m = EncoderModel(EncoderConfig(vocab_size=20, hidden_size=16, num_hidden_layers=1,
                                   num_attention_heads=2, intermediate_size=20)).eval()  # fmt: skip
    with pytest.raises(ValueError, match="global_attention_mask is for Longformer"):
        m(input_ids=torch.ones(1, 4, dtype=torch.long), global_attention_mask=torch.ones(1, 4))


@pytest.mark.parametrize("kind", ["rope", "alibi"])
def test_long_encoder_with_relative_positions(kind: str) -> None:
    cfg = EncoderConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=40, max_position_embeddings=64, attention_window=8,
        position_embedding_type=kind, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    m = EncoderModel(cfg).eval()
    assert m.embeddings.position_embeddings is None
    ids = torch.randint(1, 50, (2, 40))
    gm = torch.zeros_like(ids)
    gm[:, 0] = 1
    with torch.no_grad():
        out = m(input_ids=ids, global_attention_mask=gm).last_hidden_state
        with backends.use("reference"):
            ref = m(input_ids=ids, global_attention_mask=gm).last_hidden_state
        # relative positions: shifting every position leaves the states unchanged
        shifted = m(
            input_ids=ids, global_attention_mask=gm, position_ids=torch.arange(40) + 7
        ).last_hidden_state
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(shifted, out, atol=1e-4, rtol=0)


def test_work_grows_with_n_times_w() -> None:
    """The blocks a block-skipping backend computes double when n doubles (n * w, not n^2)."""
    from attnlab.backends.sparse import BLOCK

    counts = []
    for n in (1024, 2048, 4096):
        glob = torch.zeros(1, n, dtype=torch.long)
        glob[0, 0] = 1
        pattern = longformer_pattern(256, glob, None)
        needed, _ = pattern.block_mask(n, n, BLOCK, BLOCK)
        counts.append(int(needed.sum()))
    assert counts[1] / counts[0] < 2.2 and counts[2] / counts[1] < 2.2
    assert counts[2] < 0.25 * (4096 // BLOCK) ** 2  # far from the full n^2 grid
