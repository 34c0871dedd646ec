"""Edge inputs of the attention call, generated per class (issue 9, classes 1, 3 and 8).

* class 1, empty sequences: ``L = 0`` gives an empty output, ``S = 0`` zeros, on the
  functional call and on every backend, with gradients that flow (as zeros);
* class 3, pattern data that does not fit the call (documents or padding shorter than
  the positions, global tokens beyond the sequence or not integers): a ``ValueError`` or
  ``TypeError`` naming the value, at the call, never a silent reinterpretation;
* class 8, NaN in, NaN out: a NaN in the query, key or value gives NaN exactly where
  the reference gives it, on every exact backend, small shapes included.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import scaled_dot_product_attention
from attnlab.backends.linear import linear_attention
from attnlab.backends.sparse import sparse_attention
from attnlab.backends.tiled import tiled_attention
from attnlab.functional import masks as M
from attnlab.functional import sdpa_reference

EXACT = ["reference", "sdpa", "tiled", "sparse"]


@settings(max_examples=40)
@given(
    backend=st.sampled_from(EXACT),
    empty=st.sampled_from(["L", "S", "both"]),
    n=st.integers(1, 9),
    gqa=st.booleans(),
    mask=st.sampled_from(["none", "causal", "pattern", "bool"]),
    weights=st.booleans(),
)
def test_empty_sequences(
    backend: str, empty: str, n: int, gqa: bool, mask: str, weights: bool
) -> None:
    L = 0 if empty in ("L", "both") else n
    S = 0 if empty in ("S", "both") else n
    h_kv = 1 if gqa else 2
    q = torch.randn(2, 2, L, 4, requires_grad=True)
    k = torch.randn(2, h_kv, S, 4, requires_grad=True)
    v = torch.randn(2, h_kv, S, 3, requires_grad=True)
    attn_mask = {
        "none": None,
        "causal": None,
        "pattern": M.sliding_window(2) & M.causal(),
        "bool": torch.ones(L, S, dtype=torch.bool),
    }[mask]
    if backend == "sparse" and mask == "bool":
        attn_mask = None
    out = scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask,
        is_causal=mask == "causal",
        enable_gqa=gqa,
        backend=backend,
        return_weights=weights,
    )
    if weights:
        assert isinstance(out, tuple)
        out, w = out
        assert w.shape == (2, 2, L, S)
    assert isinstance(out, torch.Tensor)
    assert out.shape == (2, 2, L, 3)
    assert not out.isnan().any() and (out == 0).all()
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and (t.grad == 0).all()


@pytest.mark.parametrize("fn", [tiled_attention, sparse_attention, linear_attention])
def test_empty_sequences_on_the_backend_functions(fn) -> None:  # type: ignore[no-untyped-def]
    q = torch.randn(1, 2, 3, 4)
    k = v = torch.randn(1, 2, 0, 4)
    out, _ = fn(q, k, v)
    assert out.shape == (1, 2, 3, 4) and (out == 0).all()
    out, _ = fn(q[:, :, :0], q, q)
    assert out.shape == (1, 2, 0, 4)


@settings(max_examples=60)
@given(
    backend=st.sampled_from(EXACT),
    where=st.sampled_from(["query", "key", "value"]),
    L=st.integers(1, 20),
    S=st.integers(1, 20),
    E=st.sampled_from([4, 8, 64]),
    mask=st.sampled_from(["none", "causal", "window", "bool"]),
    seed=st.integers(0, 1000),
)
def test_nan_in_nan_out_like_the_reference(
    backend: str, where: str, L: int, S: int, E: int, mask: str, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, L, E, generator=g)
    k = torch.randn(1, 2, S, E, generator=g)
    v = torch.randn(1, 2, S, E, generator=g)
    t = {"query": q, "key": k, "value": v}[where]
    idx = tuple(int(torch.randint(0, n, (1,), generator=g)) for n in t.shape)
    t[idx] = float("nan")
    attn_mask = {
        "none": None,
        "causal": None,
        "window": M.sliding_window(2),
        "bool": torch.rand(L, S, generator=g) > 0.3,
    }[mask]
    if backend == "sparse" and mask == "bool":
        attn_mask = M.sliding_window(1, 1)
    kw = {"is_causal": mask == "causal"}
    ref = scaled_dot_product_attention(q, k, v, attn_mask, backend="reference", **kw)
    out = scaled_dot_product_attention(q, k, v, attn_mask, backend=backend, **kw)
    assert isinstance(out, torch.Tensor) and isinstance(ref, torch.Tensor)
    assert torch.equal(out.isnan(), ref.isnan()), (backend, where, idx)
    assert ref.isnan().any() or where == "key" or mask != "none"
    finite = ~ref.isnan()
    torch.testing.assert_close(out[finite], ref[finite], atol=2e-5, rtol=1e-4)


def test_reference_propagates_nan_from_the_small_shape_that_sdpa_missed() -> None:
    """The case the issue names: (L, S, E) = (4, 4, 8), NaN in the query."""
    q, k, v = (torch.randn(1, 1, 4, 8) for _ in range(3))
    q[0, 0, 0, 0] = float("nan")
    out = scaled_dot_product_attention(q, k, v)
    assert isinstance(out, torch.Tensor)
    assert out[0, 0, 0].isnan().all() and not out[0, 0, 1:].isnan().any()
    ref, _ = sdpa_reference(q, k, v)
    assert torch.equal(out.isnan(), ref.isnan())


@pytest.mark.parametrize(
    ("pattern", "error", "match"),
    [
        (lambda: M.document([0, 0, 1]), ValueError, "document ids cover 3 positions"),
        (lambda: M.padding(torch.ones(1, 3)), ValueError, "padding mask covers 3 positions"),
        (lambda: M.global_tokens([100]), ValueError, "global token index 100"),
        (lambda: M.global_tokens([1.7]), TypeError, "must be ints"),
        (lambda: M.global_tokens(torch.tensor([1.5])), TypeError, "must be integers"),
        (lambda: M.global_tokens([True]), TypeError, "must be ints"),
        (lambda: M.causal() & M.document([0, 1]), ValueError, "document ids cover 2"),
        (lambda: (M.sliding_window(1) | M.global_tokens([4])).with_scores(), ValueError, "index 4"),
    ],
)
def test_pattern_data_that_does_not_fit_the_call(pattern, error, match) -> None:  # type: ignore[no-untyped-def]
    q = k = v = torch.randn(1, 1, 4, 8)
    with pytest.raises(error, match=match):
        scaled_dot_product_attention(q, k, v, pattern())


def test_padding_over_every_slot_fits_a_call_that_sees_some() -> None:
    """Longer data is fine: a padding mask over 6 slots, a decode step over 4 of them."""
    q = torch.randn(1, 1, 1, 8)
    k = v = torch.randn(1, 1, 4, 8)
    pattern = M.padding(torch.tensor([[0, 1, 1, 1, 1, 1]])) & M.causal()
    out = scaled_dot_product_attention(
        q, k, v, pattern, q_positions=torch.tensor([[5]]), k_positions=torch.tensor([[2, 3, 4, 5]])
    )
    assert isinstance(out, torch.Tensor) and out.isfinite().all()
    with pytest.raises(
        ValueError, match="padding mask covers 6 positions but the call's keys reach 7"
    ):
        scaled_dot_product_attention(
            q,
            k,
            v,
            pattern,
            q_positions=torch.tensor([[6]]),
            k_positions=torch.tensor([[3, 4, 5, 6]]),
        )
