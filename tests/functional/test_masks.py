"""Masks: dense helpers and patterns, checked against hand-built definitions."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import scaled_dot_product_attention as sdpa
from attnlab.functional import masks


def _grid(L: int, S: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.arange(L).view(-1, 1) + offset
    k = torch.arange(S).view(1, -1)
    return q.expand(L, S), k.expand(L, S)


@pytest.mark.parametrize(("L", "S"), [(4, 4), (3, 7), (7, 3), (1, 5)])
def test_causal_mask_top_left_matches_torch(L: int, S: int) -> None:
    # torch's is_causal is tril(ones(L, S)) (top-left aligned)
    expected = torch.ones(L, S, dtype=torch.bool).tril()
    assert torch.equal(masks.causal_mask(L, S), expected)
    assert torch.equal(masks.causal().to_dense(L, S), expected)


def test_causal_mask_bottom_right_offset_for_cached_decoding() -> None:
    # 2 new queries after 5 cached keys: query i sits at position 5 + i among 7 keys.
    m = masks.causal_mask(2, 7, offset=5)
    assert m.tolist() == [[True] * 6 + [False], [True] * 7]
    assert torch.equal(masks.causal().to_dense(2, 7, q_offset=5), m)
    # decoding one token sees every key
    assert masks.causal_mask(1, 9, offset=8).all()


def test_padding_mask_from_hf_attention_mask() -> None:
    am = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])
    pm = masks.padding_mask(am)
    assert pm.shape == (2, 1, 1, 4) and pm.dtype == torch.bool
    assert pm[:, 0, 0].tolist() == [[True, True, True, False], [False, True, True, True]]


def test_lengths_mask() -> None:
    m = masks.lengths_mask([3, 1], max_len=4)
    assert m.shape == (2, 1, 1, 4)
    assert m[:, 0, 0].tolist() == [[True, True, True, False], [True, False, False, False]]
    assert torch.equal(
        masks.lengths_mask(torch.tensor([2, 4])),
        masks.padding_mask(torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])),
    )


def test_combine_bool_and_float() -> None:
    pad = masks.padding_mask(torch.tensor([[1, 1, 0]]))  # [1, 1, 1, 3]
    causal = masks.causal_mask(3, 3)  # [3, 3]
    both = masks.combine(causal, pad)
    assert both is not None and both.shape == (1, 1, 3, 3)
    assert both[0, 0].tolist() == [[True, False, False], [True, True, False], [True, True, False]]
    bias = torch.full((3, 3), 0.5)
    mixed = masks.combine(bias, pad)
    assert mixed is not None and mixed.dtype == torch.float32
    assert mixed[0, 0, 0].tolist() == [0.5, 0.5, float("-inf")]
    assert masks.combine(None, None) is None


def test_causal_and_padding_in_attention_equal_manual() -> None:
    q = torch.randn(2, 2, 4, 8)
    am = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    mask = masks.combine(masks.causal_mask(4), masks.padding_mask(am))
    out = sdpa(q, q, q, mask, backend="reference")
    manual = torch.zeros(2, 2, 4, 8)
    for b in range(2):
        n = int(am[b].sum())
        for i in range(4):
            keys = [j for j in range(min(i, n - 1) + 1)]
            s = (q[b, :, i : i + 1] @ q[b, :, keys].transpose(-2, -1)) / 8**0.5
            manual[b, :, i] = (torch.softmax(s, -1) @ q[b, :, keys])[:, 0]
    torch.testing.assert_close(out, manual)


DEFINITIONS = {
    "sliding(2,0)": (masks.sliding_window(2), lambda q, k: (q - k >= 0) & (q - k <= 2)),
    "sliding(1,2)": (masks.sliding_window(1, 2), lambda q, k: (q - k <= 1) & (k - q <= 2)),
    "global([0,3])": (
        masks.global_tokens([0, 3]),
        lambda q, k: (q == 0) | (q == 3) | (k == 0) | (k == 3),
    ),
    "dilated(2,2)": (masks.dilated(2, 2), lambda q, k: ((q - k).abs() <= 4) & ((q - k) % 2 == 0)),
    "prefix(3)": (masks.prefix_lm(3), lambda q, k: (k < 3) | (k <= q)),
    "document": (
        masks.document([0, 0, 1, 1, 1, 2, 2, 2]),
        lambda q, k: (
            torch.tensor([0, 0, 1, 1, 1, 2, 2, 2])[q.clamp(max=7)]
            == torch.tensor([0, 0, 1, 1, 1, 2, 2, 2])[k.clamp(max=7)]
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(DEFINITIONS))
def test_patterns_match_their_definition(name: str) -> None:
    pattern, rule = DEFINITIONS[name]
    q, k = _grid(8, 8)
    assert torch.equal(pattern.to_dense(8, 8), rule(q, k))
    assert pattern.density(8, 8) == pytest.approx(rule(q, k).float().mean().item())


@settings(max_examples=40)
@given(
    a=st.sampled_from(sorted(DEFINITIONS)),
    b=st.sampled_from(sorted(DEFINITIONS)),
    op=st.sampled_from(["&", "|"]),
)
def test_pattern_algebra(a: str, b: str, op: str) -> None:
    pa, pb = DEFINITIONS[a][0], DEFINITIONS[b][0]
    da, db = pa.to_dense(8, 8), pb.to_dense(8, 8)
    combined = (pa & pb) if op == "&" else (pa | pb)
    assert torch.equal(combined.to_dense(8, 8), (da & db) if op == "&" else (da | db))
    assert torch.equal((~pa).to_dense(8, 8), ~da)


def test_pattern_as_attn_mask_equals_its_dense_form() -> None:
    q = torch.randn(1, 2, 8, 4)
    p = masks.causal() & masks.sliding_window(3)
    torch.testing.assert_close(
        sdpa(q, q, q, p), sdpa(q, q, q, p.to_dense(8, 8), backend="reference")
    )


def test_batch_dependent_patterns() -> None:
    am = torch.tensor([[1, 1, 0], [1, 1, 1]])
    dense = (masks.padding(am) & masks.causal()).to_dense(3, 3)
    assert dense.shape == (2, 1, 3, 3)
    assert torch.equal(dense, masks.combine(masks.causal_mask(3), masks.padding_mask(am)))
    docs = masks.document(torch.tensor([[0, 0, 1], [0, 1, 1]])).to_dense(3, 3)
    assert docs[0, 0].tolist() == [[True, True, False], [True, True, False], [False, False, True]]
    with pytest.raises(ValueError, match="batch size 2"):
        sdpa(
            torch.randn(3, 1, 3, 4),
            torch.randn(3, 1, 3, 4),
            torch.randn(3, 1, 3, 4),
            masks.padding(am),
        )
