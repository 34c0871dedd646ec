"""``EncoderModel.encode`` against sentence-transformers' ``encode`` on all-MiniLM-L6-v2.

Tolerance: 1e-5 per component (float32), as the issue asks; measured differences are
~2e-7. The packed and padded layouts are also compared with each other.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

import attnlab
from attnlab.functional.pooling import pool_segments
from attnlab.models.embedding import SentenceSettings

st_module = pytest.importorskip("sentence_transformers")

TEXTS = [
    "time flies like an arrow",
    "fruit flies like a banana",
    "",
    "attention",
    "the quick brown fox jumps over the lazy dog near the river bank " * 3,
    "Return the number of items in a container.",
]
LONG = "packing puts many sentences in one row " * 60  # ~360 tokens, past 256


@pytest.fixture(scope="module")
def st(minilm_path: Path):
    return st_module.SentenceTransformer(str(minilm_path), device="cpu")


@pytest.fixture(scope="module")
def model(minilm_path: Path):
    return attnlab.from_hf(minilm_path)


def test_folder_settings_are_read(model) -> None:
    s = model.sentence_settings
    assert s.pooling == ("mean",) and s.normalize and s.max_seq_length == 256
    assert model.tokenizer is not None


@pytest.mark.parametrize("strategy", ["auto", "packed", "padded"])
def test_equals_sentence_transformers(model, st, strategy: str) -> None:
    texts = [*TEXTS, LONG]
    want = st.encode(texts, convert_to_tensor=True, batch_size=4)
    got, report = model.encode(texts, strategy=strategy, batch_size=4, return_report=True)
    assert got.shape == (len(texts), 384)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert report.truncated == 1 and report.max_seq_length == 256
    if strategy != "auto":
        assert report.strategy == strategy


def test_single_text_and_empty_string(model, st) -> None:
    for text in ("time flies like an arrow", ""):
        want = st.encode(text, convert_to_tensor=True)
        got = model.encode(text)
        assert got.shape == (384,)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_packed_equals_padded_and_token_ids(model) -> None:
    packed = model.encode(TEXTS, strategy="packed", batch_size=2)
    padded = model.encode(TEXTS, strategy="padded", batch_size=2)
    torch.testing.assert_close(packed, padded, atol=1e-6, rtol=0)
    ids = [model.tokenizer.encode(t).ids for t in TEXTS]
    torch.testing.assert_close(model.encode(ids), padded, atol=1e-6, rtol=0)


def test_truncation_is_reported(model, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="attnlab.models.embedding"):
        _, report = model.encode([LONG, LONG, "short"], return_report=True)
    assert report.truncated == 2
    assert "2 of 3 texts exceed max_seq_length=256" in caplog.text
    assert "2 text(s) longer than max_seq_length=256" in str(report)


def test_bfloat16_close_to_float32(model) -> None:
    f32 = model.encode(TEXTS)
    b16 = model.encode(TEXTS, dtype=torch.bfloat16)
    cos = torch.nn.functional.cosine_similarity(f32, b16, dim=-1)
    assert float(cos.min()) >= 0.999


def test_bad_inputs(model) -> None:
    with pytest.raises(TypeError, match="item 1 is int"):
        model.encode(["a text", 3])
    with pytest.raises(TypeError, match="inputs must be"):
        model.encode(42)
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        model.encode(["a"], batch_size=0)
    with pytest.raises(ValueError, match="strategy must be one of"):
        model.encode(["a"], strategy="fastest")
    with pytest.raises(ValueError, match="dtype must be"):
        model.encode(["a"], dtype=torch.float16)
    with pytest.raises(ValueError, match="token-id list 0 has 300 ids"):
        model.encode([[101] * 300])
    with pytest.raises(ValueError, match="outside"):
        model.encode([[101, 10**6, 102]])
    assert model.encode([]).shape == (0, 384)


def test_folder_without_pooling_config_falls_back_to_mean(
    minilm_path: Path, tmp_path: Path
) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(minilm_path / name, tmp_path / name)
    m = attnlab.from_hf(tmp_path)
    assert m.sentence_settings.pooling == ("mean",)
    assert not m.sentence_settings.normalize
    assert "no modules.json" in m.sentence_settings.source
    got, report = m.encode(TEXTS, return_report=True)
    assert "no modules.json" in str(report)
    # sentence-transformers' own fallback for a plain folder: mean pooling, not normalised
    plain = st_module.SentenceTransformer(str(tmp_path), device="cpu")
    want = plain.encode(TEXTS, convert_to_tensor=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("config", "modes"),
    [
        (
            {
                "word_embedding_dimension": 384,
                "pooling_mode_cls_token": True,
                "pooling_mode_max_tokens": True,
            },
            ("cls", "max"),
        ),
        ({"embedding_dimension": 384, "pooling_mode": ["max", "cls"]}, ("max", "cls")),
    ],
)
def test_cls_and_max_pooling_follow_the_config(
    minilm_path: Path, tmp_path: Path, config: dict, modes: tuple[str, ...]
) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "modules.json"):
        shutil.copy(minilm_path / name, tmp_path / name)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(config))
    m = attnlab.from_hf(tmp_path)
    assert m.sentence_settings.pooling == modes
    st2 = st_module.SentenceTransformer(str(tmp_path), device="cpu")
    want = st2.encode(TEXTS[:4], convert_to_tensor=True)
    got = m.encode(TEXTS[:4])
    assert got.shape == (4, 768)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_pool_segments_matches_padded_reference() -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 5, 3, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    seg = torch.where(mask.bool(), torch.arange(2)[:, None], -1).flatten()
    got = pool_segments(h.reshape(-1, 3), seg, 2, ("cls", "max", "mean", "mean_sqrt_len"))
    m = mask[..., None].double()
    mean = (h * m).sum(1) / m.sum(1)
    mx = h.masked_fill(m == 0, float("-inf")).amax(1)
    want = torch.cat([h[:, 0], mx, mean, (h * m).sum(1) / m.sum(1).sqrt()], dim=-1)
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="no token"):
        pool_segments(h.reshape(-1, 3), seg, 3)


def test_settings_validation() -> None:
    with pytest.raises(ValueError, match="unknown pooling"):
        SentenceSettings(pooling=("weightedmean",))
    with pytest.raises(ValueError, match="max_seq_length"):
        SentenceSettings(max_seq_length=1)
