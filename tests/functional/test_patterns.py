"""Pattern structure: tiles (block_mask) and density agree with the dense pattern."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnlab.functional import masks as M


def _docs(n: int, cut: list[int]) -> list[int]:
    ids, doc = [], 0
    for i in range(n):
        if i in cut:
            doc += 1
        ids.append(doc)
    return ids


@st.composite
def patterns(draw: st.DrawFn, n: int) -> M.MaskPattern:
    def base() -> M.MaskPattern:
        kind = draw(
            st.sampled_from(
                ["causal", "full", "window", "global", "dilated", "doc", "doc_b", "prefix", "pad"]
            )
        )
        if kind == "causal":
            return M.causal()
        if kind == "full":
            return M.full()
        if kind == "window":
            return M.sliding_window(draw(st.integers(0, n)), draw(st.integers(0, 5)))
        if kind == "global":
            return M.global_tokens(draw(st.lists(st.integers(0, n + 3), min_size=1, max_size=4)))
        if kind == "dilated":
            return M.dilated(
                draw(st.integers(0, 4)), draw(st.integers(1, 3)), causal=draw(st.booleans())
            )
        if kind == "doc":
            return M.document(_docs(n, draw(st.lists(st.integers(1, n), max_size=4))))
        if kind == "doc_b":
            return M.document(
                torch.tensor(
                    [_docs(n, draw(st.lists(st.integers(1, n), max_size=4))) for _ in range(2)]
                )
            )
        if kind == "prefix":
            return M.prefix_lm(draw(st.integers(0, n)))
        keep = draw(
            st.lists(st.lists(st.booleans(), min_size=n, max_size=n), min_size=2, max_size=2)
        )
        return M.padding(torch.tensor(keep, dtype=torch.long))

    p = base()
    for _ in range(draw(st.integers(0, 2))):
        op = draw(st.sampled_from("&|~"))
        p = ~p if op == "~" else (p & base() if op == "&" else p | base())
    return p


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    data=st.data(),
    L=st.integers(1, 30),
    S=st.integers(1, 30),
    bq=st.integers(1, 9),
    bk=st.integers(1, 9),
    offset=st.integers(0, 6),
)
def test_block_mask_brackets_the_dense_pattern(
    data: st.DataObject, L: int, S: int, bq: int, bk: int, offset: int
) -> None:
    p = data.draw(patterns(max(L, S) + offset))
    dense = p.to_dense(L, S, q_offset=offset)
    if dense.dim() == 4:  # batch-dependent: a tile is needed if any sequence needs it
        d_any, d_all = dense.any(0)[0], dense.all(0)[0]
    else:
        d_any = d_all = dense
    any_, all_ = p.block_mask(L, S, bq, bk, q_offset=offset)
    nq, nk = -(-L // bq), -(-S // bk)
    assert any_.shape == all_.shape == (nq, nk)
    for i in range(nq):
        for j in range(nk):
            tile_any = d_any[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            tile_all = d_all[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            if bool(tile_any.any()):
                assert any_[i, j], (p, i, j)  # never skip a tile with an attended pair
            if all_[i, j]:
                assert bool(tile_all.all()), (p, i, j)  # "full" tiles really are full
    # the density is exact
    assert p.density(L, S, q_offset=offset) == pytest.approx(dense.double().mean().item())


@pytest.mark.parametrize(
    ("pattern", "exact"),
    [
        (M.causal(), True),
        (M.sliding_window(5, 2), True),
        (M.prefix_lm(7), True),
        (M.global_tokens([0, 9]), True),
        (M.document(_docs(32, [5, 12, 20])), True),
    ],
)
def test_block_mask_is_exact_for_simple_patterns(pattern: M.MaskPattern, exact: bool) -> None:
    dense = pattern.to_dense(32, 32)
    any_, all_ = pattern.block_mask(32, 32, 4, 4)
    tiles = dense.view(8, 4, 8, 4)
    assert torch.equal(any_, tiles.any(3).any(1))
    assert torch.equal(all_, tiles.all(3).all(1))


def test_analytic_density_for_long_sequences() -> None:
    assert M.causal().density(32768) == pytest.approx(0.5, abs=1e-4)
    w = M.sliding_window(511).density(32768)
    assert w == pytest.approx((512 * 32768 - 511 * 512 / 2) / 32768**2)
    assert M.full().density(100, 7) == 1.0


def test_block_mask_rejects_bad_blocks() -> None:
    with pytest.raises(ValueError, match="block_q must be a positive int, got 0"):
        M.causal().block_mask(8, 8, 0, 4)


def test_global_tokens_lookup_matches_isin() -> None:
    g = M.global_tokens([3, 1, 3, 40])
    pos = torch.arange(-2, 50)
    assert torch.equal(g._is_global(pos), torch.isin(pos, torch.tensor([1, 3, 40])))
