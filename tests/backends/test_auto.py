"""``auto``: returns what the reference returns, picks by the cost model, explains itself."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnlab import backends, scaled_dot_product_attention
from attnlab.backends import cost_model, explain, use
from attnlab.functional import masks as M
from attnlab.functional import sdpa_reference
from attnlab.functional.score_mods import softcap


def _view(*shape: int) -> torch.Tensor:
    """A large tensor that costs no memory: explain only reads shapes."""
    return torch.zeros(1, 1, 1, 1).expand(*shape)


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    L=st.integers(1, 20),
    S=st.integers(1, 20),
    heads=st.sampled_from([(2, 1), (2, 2), (3, 1)]),
    mask_kind=st.sampled_from(["none", "causal", "window", "doc", "bool", "float"]),
    weights=st.booleans(),
    grad=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_auto_returns_what_the_reference_returns(
    L: int, S: int, heads: tuple[int, int], mask_kind: str, weights: bool, grad: bool, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    h, h_kv = heads
    q = torch.randn(1, h, L, 8, generator=g, requires_grad=grad)
    k = torch.randn(1, h_kv, S, 8, generator=g, requires_grad=grad)
    v = torch.randn(1, h_kv, S, 8, generator=g, requires_grad=grad)
    mask: torch.Tensor | M.MaskPattern | None = {
        "none": None,
        "causal": M.causal(),
        "window": M.sliding_window(3, 1),
        "doc": M.document([i // 5 for i in range(max(L, S))]) & M.causal(),
        "bool": torch.rand(L, S, generator=g) > 0.5,
        "float": torch.randn(L, S, generator=g),
    }[mask_kind]
    got = scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, return_weights=weights)
    dense = mask.to_dense(L, S) if isinstance(mask, M.MaskPattern) else mask
    want = sdpa_reference(q, k, v, dense, enable_gqa=True, return_weights=weights)
    if weights:
        assert isinstance(got, tuple)
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])
    else:
        torch.testing.assert_close(got, want[0])


def test_causal_dense_goes_to_torch_sdpa() -> None:
    x = _view(1, 12, 4096, 64)
    e = explain(x, x, x, is_causal=True)
    assert e.chosen == "sdpa"
    assert "chosen" in e.reasons["sdpa"]


def test_long_sliding_window_skips_blocks_and_says_why_sdpa_lost() -> None:
    x = _view(1, 12, 16384, 64)
    e = explain(x, x, x, M.sliding_window(511))
    assert e.chosen in ("tiled", "sparse", "flex")
    assert "cannot skip the empty blocks" in e.reasons["sdpa"]
    assert "not compiled for this shape yet" in e.reasons["flex"]
    assert "never by auto" in e.reasons["linear"]
    assert set(e.reasons) == set(backends.available())
    assert str(e).startswith(f"backend: {e.chosen}")


def test_score_mods_and_dropout_rule_backends_out() -> None:
    x = _view(1, 2, 256, 64)
    e = explain(x, x, x, M.causal().with_scores(softcap(5.0)), return_weights=True)
    assert e.chosen != "sdpa" and "score modifiers" in e.reasons["sdpa"]
    e = explain(x, x, x, dropout_p=0.1)
    assert e.chosen in ("sdpa", "reference")
    assert "dropout" in e.reasons["tiled"]


def test_flex_chosen_once_compiled_if_cheapest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("attnlab.backends.flex.is_compiled", lambda call: True)
    x = _view(1, 12, 8192, 64)
    e = explain(x, x, x, M.sliding_window(255))
    assert "not compiled" not in e.reasons["flex"]
    estimates = {
        name: backends.get(name).cost(call)  # type: ignore[misc]
        for name, call in [
            (
                n,
                backends.AttentionCall.from_inputs(
                    x,
                    x,
                    x,
                    M.sliding_window(255),
                    dropout_p=0.0,
                    is_causal=False,
                    enable_gqa=False,
                    return_weights=False,
                ),
            )
            for n in ("tiled", "sparse", "flex", "sdpa", "reference")
        ]
    }
    best = min(estimates, key=lambda n: estimates[n].seconds)  # type: ignore[union-attr]
    assert e.chosen == best


def test_use_sets_the_backend_for_auto_only() -> None:
    x = torch.randn(1, 1, 8, 4)
    free_choice = explain(x, x, x).chosen
    with use("tiled"):
        assert explain(x, x, x).chosen == "tiled"
        assert explain(x, x, x, backend="reference").chosen == "reference"
        with use("auto"):
            assert explain(x, x, x).chosen == free_choice
    with use("sparse"), pytest.raises(ValueError, match=r"sparse.*dense mask"):
        scaled_dot_product_attention(x, x, x, torch.ones(8, 8, dtype=torch.bool))


def test_cost_model_counts_tiles() -> None:
    x = _view(1, 1, 1024, 64)
    call = backends.AttentionCall.from_inputs(
        x, x, x, None, dropout_p=0.0, is_causal=True, enable_gqa=False, return_weights=False
    )
    pairs = cost_model.computed_pairs(call, 256, 256)
    assert pairs == 10 * 256 * 256  # 4 x 4 tiles, the lower triangle with the diagonal
    assert cost_model.units(call, pairs) == pairs


def test_a_models_decode_step_is_costed_at_its_slot() -> None:
    """A call with positions has its queries at the newest slots: one causal query after a
    4096-slot cache sees every key tile, not only the first (which put `auto` on `tiled`,
    13x slower than sdpa, for padded decode steps)."""
    q = torch.zeros(4, 8, 1, 64)
    k = torch.zeros(4, 2, 4096, 64)
    mask = torch.ones(4, 4096, dtype=torch.long)
    mask[::2, :100] = 0
    pattern = M.causal() & M.padding(mask)
    call = backends.AttentionCall.from_inputs(
        q, k, k, pattern, dropout_p=0.0, is_causal=False, enable_gqa=True,
        return_weights=False, positions=True,
    )  # fmt: skip
    assert cost_model.computed_pairs(call, 256, 256) == 1 * 4096  # every key tile
    slots = torch.arange(4096)[None]
    chosen = explain(
        q, k, k, pattern, enable_gqa=True, q_positions=slots[:, -1:], k_positions=slots
    ).chosen
    assert chosen == "sdpa"  # nothing to skip: torch's kernel on the dense padding row
