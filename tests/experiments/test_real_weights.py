"""Experiments on real weights: their measurements on models with a known answer, then the
runs themselves on SmolLM2 (the session's one copy of the model)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from attnlab.experiments import _real, run_experiment
from attnlab.experiments.context import chunked_nll
from attnlab.experiments.induction import prefix_matching_scores
from attnlab.experiments.induction_real import ablated, copying_scores, repeated_rows
from attnlab.experiments.sinks import recompute_nll, windowed
from attnlab.generation import sink_cache
from attnlab.models import DecoderConfig, DecoderLM

TINY: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    max_position_embeddings=128,
    tie_word_embeddings=True,
)


class _Attends(torch.nn.Module):
    """A stand-in model whose only head attends exactly as an induction head does."""

    def __init__(self, period: int) -> None:
        super().__init__()
        self.period = period

    def forward(self, input_ids: torch.Tensor, output_attentions: bool = False) -> Any:
        b, n = input_ids.shape
        att = torch.zeros(b, 1, n, n)
        for q in range(n):
            k = q - self.period + 1 if q >= self.period else 0
            att[:, 0, q, k] = 1.0
        return SimpleNamespace(attentions=[att])


def test_a_perfect_induction_head_scores_one() -> None:
    ids = repeated_rows(3, 10, low=0, high=50, seed=0)
    scores = prefix_matching_scores(_Attends(10), ids, torch.full((3,), 10))
    torch.testing.assert_close(scores, torch.ones(1, 1))


def test_copying_score_of_a_copying_and_an_anti_copying_head() -> None:
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.llama(**TINY)).eval()
    attn = model.layers[0].self_attention
    hd = attn.head_dim
    p = torch.linalg.qr(torch.randn(32, hd))[0].T  # [hd, D], orthonormal rows
    with torch.no_grad():
        attn.v_proj.weight[:hd] = p  # kv head 0 serves heads 0 and 1
        attn.out_proj.weight[:, :hd] = p.T  # head 0: O V = P^T P, a projection
        attn.out_proj.weight[:, hd : 2 * hd] = -p.T  # head 1: its negation
    scores = copying_scores(model)
    assert scores.shape == (2, 4)
    assert scores[0, 0] == pytest.approx(1.0, abs=1e-6)
    assert scores[0, 1] == pytest.approx(-1.0, abs=1e-6)


def test_ablating_every_head_equals_a_zero_output_projection() -> None:
    torch.manual_seed(1)
    model = DecoderLM(DecoderConfig.llama(**TINY)).eval()
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad(), ablated(model, [(1, h) for h in range(4)]):
        got = model(ids).logits
    with torch.no_grad():
        model.layers[1].self_attention.out_proj.weight.zero_()
        want = model(ids).logits
    torch.testing.assert_close(got, want)


def test_recomputation_equals_the_full_forward_when_the_window_holds_everything() -> None:
    torch.manual_seed(2)
    model = DecoderLM(DecoderConfig.llama(**TINY)).eval()
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        full = _real.next_token_nll(model(ids).logits[:, :-1], ids[:, 1:])[0]
    # a window of t + 1 tokens ending at t is the whole prefix
    got = torch.stack([recompute_nll(model, ids, [t], t + 1)[0] for t in range(11)])
    torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)


def test_a_window_cache_stream_equals_a_sliding_window_prefill() -> None:
    # sinks' (a): decoding through a window cache of C keys is a sliding window of C
    torch.manual_seed(3)
    model = DecoderLM(DecoderConfig.llama(**TINY)).eval()
    ids = torch.randint(0, 64, (1, 40))
    stream = _real.stream_nll(model, ids, sink_cache(model, window=9, sinks=0))
    with windowed(model, 9):
        chunks = chunked_nll(model, ids, chunk=16)
    assert model.layer_windows == (None, None)
    torch.testing.assert_close(chunks, stream, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        full = _real.next_token_nll(model(ids).logits[:, :-1], ids[:, 1:])[0]
    assert not torch.allclose(chunks[20:], full[20:], atol=1e-3)  # the window did cut


@pytest.fixture
def real_model(smollm2: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    monkeypatch.setattr(_real, "load_smollm2", lambda: smollm2)
    return smollm2


def test_sinks_pipeline_on_smollm2(real_model: torch.nn.Module, tmp_path: Path) -> None:
    result = run_experiment("sinks", smoke=True, out=tmp_path, progress=False)
    assert [r["method"][:3] for r in result.rows] == ["(a)", "(b)", "(c)"]
    assert all(r["ppl_scored"] > 1 for r in result.rows)
    assert (tmp_path / "results.json").is_file()


def test_induction_real_quick_on_smollm2(real_model: torch.nn.Module, tmp_path: Path) -> None:
    result = run_experiment("induction-real", quick=True, out=tmp_path, progress=False)
    # a trained 30-layer decoder has induction heads past its first layer
    assert result.rows and all(r["prefix_matching"] >= 0.3 for r in result.rows)
    assert any(r["layer"] > 0 for r in result.rows)
    assert result.settings["loss_ablated"] > result.settings["loss_repeat"]
