"""The sparse backend's banded path: when it is planned, and that it equals the reference.

The hypothesis cases of ``test_exact_backends.py`` run both of the sparse backend's paths
(about half of their patterns are planned as bands); these tests pin the Longformer
pattern (window, global keys, padding, ragged lengths), the plan itself, the gather path
on the same inputs, and ``auto``'s choice at 4096 tokens.
"""

from __future__ import annotations

import pytest
import torch

import attnlab.backends.sparse as sparse
from attnlab import scaled_dot_product_attention
from attnlab.backends import explain
from attnlab.backends.banded import BAND_BLOCKS, band_pairs, band_plan, choose_band
from attnlab.functional import masks as M
from attnlab.functional import sdpa_reference
from attnlab.functional.score_mods import symmetric_alibi
from attnlab.modules.longformer_attention import longformer_pattern


def _needed(pattern: M.MaskPattern, n: int, block: int = 64) -> torch.Tensor:
    return pattern.block_mask(n, n, block, block)[0]


def _longformer_case(n: int = 700) -> tuple[M.MaskPattern, torch.Tensor]:
    glob = torch.zeros(2, n, dtype=torch.bool)
    glob[0, [0, 300]] = True
    glob[1, [5, n - 50, n - 1]] = True
    keep = torch.ones(2, n, dtype=torch.bool)
    keep[1, n - 100 :] = False
    return longformer_pattern(128, glob & keep, keep), keep


def test_plan_for_windows_and_global_keys_not_for_causal_or_full() -> None:
    n = 1024
    window = band_plan(_needed(M.sliding_window(128, 128), n))
    assert window is not None and window.offsets == tuple(range(-2, 3)) and not window.columns
    glob = torch.zeros(1, n, dtype=torch.bool)
    glob[0, [0, 700]] = True
    lf = band_plan(_needed(longformer_pattern(128, glob, None), n))
    assert lf is not None and lf.offsets == tuple(range(-2, 3)) and lf.columns == (0, 10)
    assert band_plan(_needed(M.causal(), n)) is None  # the band would be the whole triangle x2
    assert band_plan(_needed(M.full(), n)) is None


def test_extra_keys_are_the_global_tokens_not_their_blocks() -> None:
    n = 1024
    glob = torch.zeros(1, n, dtype=torch.bool)
    glob[0, [0, 500, 1000]] = True
    pairs = band_pairs(longformer_pattern(128, glob, None), n, n, (64,))
    # 5 key blocks of 64 per query block, plus the three global keys one by one.
    assert pairs == n * (5 * 64 + 3)


def test_the_block_with_the_cheapest_band_is_chosen() -> None:
    n = 2048
    pattern = M.sliding_window(300, 300)

    def block_mask(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return pattern.block_mask(n, n, b, b)

    chosen = choose_band(block_mask, (64, 128, 256))
    assert chosen is not None
    block, _, full = chosen
    costs = {}
    for b in (64, 128, 256):
        p = band_plan(block_mask(b)[0])
        assert p is not None
        costs[b] = len(p.offsets) * b * BAND_BLOCKS[b]  # per query, no columns
    assert block == min(costs, key=costs.__getitem__)
    assert full.shape == (n // block, n // block)


@pytest.mark.parametrize("score_mod", [False, True])
def test_longformer_pattern_equals_reference_forward_and_backward(score_mod: bool) -> None:
    g = torch.Generator().manual_seed(0)
    pattern, _ = _longformer_case()
    if score_mod:
        pattern = pattern.with_scores(symmetric_alibi(3))
    q, k, v = (
        torch.randn(2, 3, 700, 16, dtype=torch.float64, generator=g).requires_grad_()
        for _ in range(3)
    )
    assert band_plan(_needed(pattern._unscored(), 700)) is not None
    out = scaled_dot_product_attention(q, k, v, pattern, backend="sparse")
    dense = pattern.to_dense(700, 700)
    ref, _ = sdpa_reference(q, k, v, dense, score_mods=pattern.score_mods)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_banded_and_gather_paths_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(1)
    pattern, _ = _longformer_case(640)
    q, k, v = (torch.randn(2, 4, 640, 32, generator=g) for _ in range(3))
    with torch.inference_mode():
        banded = scaled_dot_product_attention(q, k, v, pattern, backend="sparse")
        monkeypatch.setattr(sparse, "choose_band", lambda block_mask, blocks: None)
        gathered = scaled_dot_product_attention(q, k, v, pattern, backend="sparse")
    torch.testing.assert_close(banded, gathered, atol=2e-6, rtol=1e-5)


def test_queries_at_an_offset_over_a_longer_key_range() -> None:
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 200, 16, dtype=torch.float64, generator=g)
    k, v = (torch.randn(1, 2, 700, 16, dtype=torch.float64, generator=g) for _ in range(2))
    pattern = M.causal() & M.sliding_window(150, 0)
    positions = torch.arange(500, 700)[None]
    out = scaled_dot_product_attention(q, k, v, pattern, backend="sparse", q_positions=positions)
    ref = scaled_dot_product_attention(q, k, v, pattern, backend="reference", q_positions=positions)
    torch.testing.assert_close(out, ref)


def test_auto_picks_the_banded_sparse_path_for_longformer_at_4096() -> None:
    n = 4096
    glob = torch.zeros(1, n, dtype=torch.bool)
    glob[0, [0, n // 3, n // 2]] = True
    q = torch.empty(1, 12, n, 64)
    why = explain(q, q, q, attn_mask=longformer_pattern(256, glob, None))
    assert why.chosen == "sparse", why
