"""Training data: packing with document masks, deterministic order, the synthetic tasks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnlab.models import DecoderConfig, DecoderLM
from attnlab.train.config import DataConfig
from attnlab.train.data import SyntheticData, TextData
from attnlab.train.synthetic import SEP, TRIGGER, make_task
from attnlab.train.trainer import model_inputs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for i in range(40):
        (root / f"doc{i:02d}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * (1 + i % 5))
    return root


def _text(corpus: Path, **kw: object) -> TextData:
    cfg = DataConfig(source="files", paths=[str(corpus)], seq_len=48, heldout_percent=20, **kw)
    return TextData(cfg, kind="decoder", seed=3)


def test_packed_rows_and_held_out_split(corpus: Path) -> None:
    data = _text(corpus)
    assert data.train_files + data.heldout_files == 40 and data.heldout_files > 0
    assert data.vocab_size == 256
    b = data.train_batch(0, 4)
    assert b.input_ids.shape == (4, 48)
    # a document's first token is never a target; positions restart there
    starts = torch.zeros_like(b.doc_ids, dtype=torch.bool)
    starts[:, 1:] = b.doc_ids[:, 1:] != b.doc_ids[:, :-1]
    assert (b.labels[starts] == -100).all()
    assert (b.position_ids[starts] == 0).all()
    assert b.num_targets == int((b.labels[:, 1:] != -100).sum()) == b.num_bytes


def test_order_is_a_function_of_the_sample_index(corpus: Path) -> None:
    a, b = _text(corpus), _text(corpus)
    whole = a.train_batch(5, 6)
    parts = [b.train_batch(5, 2), b.train_batch(7, 4)]
    assert torch.equal(whole.input_ids, torch.cat([p.input_ids for p in parts]))
    n = len(a.train_ids)
    second_epoch = a.train_batch(n, n).input_ids
    assert sorted(map(tuple, second_epoch.tolist())) == sorted(map(tuple, a.train_ids.tolist()))
    assert not torch.equal(second_epoch, a.train_batch(0, n).input_ids)  # reshuffled


def test_document_mask_equals_separate_documents(corpus: Path) -> None:
    torch.manual_seed(0)
    model = DecoderLM(
        DecoderConfig.gpt2(
            vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=64,
        )
    ).eval()  # fmt: skip
    data = _text(corpus)
    batch = data.train_batch(0, 8)
    row = next(i for i in range(8) if batch.doc_ids[i].max() > 0)
    one = batch.rows(row, row + 1, data.token_bytes, "decoder")
    packed = model(**{k: v for k, v in model_inputs(one, "decoder").items() if k != "labels"})
    docs = one.doc_ids[0]
    for d in docs.unique():
        sel = (docs == d).nonzero().flatten()
        alone = model(input_ids=one.input_ids[:, sel]).logits
        torch.testing.assert_close(packed.logits[:, sel], alone, rtol=1e-5, atol=1e-5)


def test_masked_lm_and_seq2seq_layouts(corpus: Path) -> None:
    cfg = DataConfig(source="files", paths=[str(corpus)], seq_len=48, heldout_percent=20)
    mlm = TextData(cfg, kind="encoder", seed=0)
    assert mlm.vocab_size == 257 and mlm.tokenizer.mask_token_id == 256
    b = mlm.train_batch(0, 16)
    chosen = b.labels != -100
    assert 0.05 < chosen.float().mean() < 0.3
    assert (b.input_ids[chosen] == 256).float().mean() > 0.6
    assert (b.input_ids[~chosen] != 256).all()
    s2s = TextData(cfg, kind="seq2seq", seed=0).train_batch(0, 2)
    assert s2s.input_ids.shape == (2, 24) and s2s.labels.shape == (2, 24)


def test_bpe_tokenizer_is_trained_on_the_training_split(corpus: Path) -> None:
    data = _text(corpus, tokenizer="bpe", bpe_vocab_size=300)
    assert 256 < data.vocab_size <= 300
    assert data.token_bytes is not None and int(data.token_bytes.max()) > 1
    b = data.train_batch(0, 2)
    assert b.num_bytes > b.num_targets  # tokens cover several bytes


def test_synthetic_tasks_are_correct() -> None:
    g = torch.Generator().manual_seed(0)
    p, a = make_task("copy", 4, length=6, num_symbols=10, generator=g)
    assert torch.equal(p[:, :6], a) and (p[:, 6] == SEP).all()
    p, a = make_task("associative_recall", 4, length=5, num_symbols=10, generator=g)
    for row, ans in zip(p, a):
        keys, values = row[:10:2], row[1:10:2]
        assert values[(keys == row[-1]).nonzero()[0, 0]] == ans[0]
    p, a = make_task("selective_copy", 4, length=5, num_symbols=10, generator=g)
    for row, ans in zip(p, a):
        assert torch.equal(row[:-1][row[:-1] > 2], ans)
    p, a = make_task("induction", 4, length=12, num_symbols=10, generator=g)
    for row, ans in zip(p, a):
        at = (row[:-1] == TRIGGER).nonzero()[0, 0]
        assert row[at + 1] == ans[0] and row[-1] == TRIGGER
    with pytest.raises(ValueError, match=r"task_length \(20\) <= num_symbols \(10\)"):
        make_task("associative_recall", 1, length=20, num_symbols=10, generator=g)


def test_synthetic_batches_for_each_kind() -> None:
    cfg = DataConfig(source="synthetic", task="copy", task_length=5, num_symbols=8)
    dec = SyntheticData(cfg, kind="decoder", seed=0).train_batch(0, 3)
    assert dec.input_ids.shape == (3, 11) and dec.num_targets == 15
    enc = SyntheticData(cfg, kind="encoder", seed=0)
    eb = enc.train_batch(0, 3)
    assert (eb.input_ids[:, -5:] == enc.mask_token_id).all() and eb.num_targets == 15
    s2s = SyntheticData(cfg, kind="seq2seq", seed=0).train_batch(0, 3)
    assert s2s.input_ids.shape == (3, 6) and s2s.labels.shape == (3, 5)
