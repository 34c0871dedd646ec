"""Score modifiers: ALiBi slopes and bias, soft-capping, and how patterns carry them."""

from __future__ import annotations

import pytest
import torch

from attnlab import scaled_dot_product_attention
from attnlab.functional import masks as M
from attnlab.functional import sdpa_reference
from attnlab.functional.score_mods import alibi, alibi_slopes, softcap


def test_alibi_slopes_follow_the_paper() -> None:
    torch.testing.assert_close(
        alibi_slopes(8).double(), torch.tensor([2.0**-i for i in range(1, 9)], dtype=torch.float64)
    )
    twelve = alibi_slopes(12)
    torch.testing.assert_close(twelve[:8], alibi_slopes(8))
    torch.testing.assert_close(twelve[8:], alibi_slopes(16)[0::2][:4])
    with pytest.raises(ValueError, match="num_heads"):
        alibi_slopes(0)


def test_alibi_is_a_distance_bias_per_head() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64, generator=g) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64)
    pos = torch.arange(5)
    bias = slopes.view(2, 1, 1) * (pos.view(1, -1) - pos.view(-1, 1))  # [H, L, S]
    want, _ = sdpa_reference(q, k, v, bias)
    got = scaled_dot_product_attention(
        q, k, v, M.full().with_scores(alibi(slopes)), backend="tiled"
    )
    torch.testing.assert_close(got, want)


def test_softcap_bounds_the_scores() -> None:
    s = torch.linspace(-100, 100, 11)
    capped = softcap(5.0)(s, s, s, s, s)
    assert capped.abs().max() <= 5.0
    torch.testing.assert_close(softcap(5.0)(s, s, s, s, s)[5], torch.tensor(0.0))
    with pytest.raises(ValueError, match=r"soft cap must be > 0, got 0.0"):
        softcap(0.0)
    with pytest.raises(ValueError, match="soft cap must be a finite number > 0, got inf"):
        softcap(float("inf"))


def test_patterns_carry_modifiers_and_refuse_late_combination() -> None:
    p = M.causal().with_scores(softcap(3.0))
    assert p.score_mods and torch.equal(p.to_dense(4, 4), M.causal().to_dense(4, 4))
    with pytest.raises(ValueError, match="combine patterns before adding score modifiers"):
        _ = p & M.sliding_window(2)
    with pytest.raises(TypeError, match="ScoreMod"):
        M.causal().with_scores(3.0)  # type: ignore[arg-type]


def test_head_count_mismatch_is_a_value_error() -> None:
    q = torch.randn(1, 3, 4, 4)
    with pytest.raises(ValueError, match="ALiBi has 2 slopes but the query has 3 heads"):
        scaled_dot_product_attention(q, q, q, M.causal().with_scores(alibi(2)), backend="tiled")


def test_sdpa_refuses_modifiers_and_auto_routes_around() -> None:
    q = torch.randn(1, 2, 6, 4)
    p = M.causal().with_scores(alibi(2))
    with pytest.raises(ValueError, match="score modifiers"):
        scaled_dot_product_attention(q, q, q, p, backend="sdpa")
    want = scaled_dot_product_attention(q, q, q, p, backend="reference")
    torch.testing.assert_close(scaled_dot_product_attention(q, q, q, p), want)
