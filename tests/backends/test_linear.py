"""The linear backend equals its quadratic form (it is an approximation of softmax, not equal)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import scaled_dot_product_attention
from attnlab.backends import explain
from attnlab.backends.linear import linear_attention
from attnlab.functional import masks as M
from attnlab.functional.linear_attention import linear_attention_reference


@settings(max_examples=80, deadline=None, derandomize=True, database=None)
@given(
    batch=st.integers(1, 2),
    h_kv=st.integers(1, 2),
    rep=st.sampled_from([1, 2]),
    L=st.integers(1, 40),
    S=st.integers(1, 40),
    causal=st.booleans(),
    padded=st.booleans(),
    chunk=st.sampled_from([1, 3, 8, 64]),
    scale=st.sampled_from([None, 0.5]),
    seed=st.integers(0, 2**16),
)
def test_equals_quadratic_form(
    batch: int,
    h_kv: int,
    rep: int,
    L: int,
    S: int,
    causal: bool,
    padded: bool,
    chunk: int,
    scale: float | None,
    seed: int,
) -> None:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, h_kv * rep, L, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(batch, h_kv, S, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(batch, h_kv, S, 5, dtype=torch.float64, generator=g, requires_grad=True)
    keep = (torch.rand(batch, 1, 1, S, generator=g) > 0.3) if padded else None
    out, w = linear_attention(q, k, v, keep, 0.0, causal, scale, True, chunk=chunk)
    assert w is None
    kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    ref = linear_attention_reference(q, kr, vr, is_causal=causal, key_mask=keep, scale=scale)
    torch.testing.assert_close(out, ref)
    grad = torch.randn(out.shape, dtype=out.dtype, generator=g)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_patterns_causal_and_padding() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 9, 4, generator=g) for _ in range(3))
    a = scaled_dot_product_attention(q, k, v, M.causal(), backend="linear")
    b = scaled_dot_product_attention(q, k, v, is_causal=True, backend="linear")
    torch.testing.assert_close(a, b)
    pad = torch.tensor([[1] * 9, [1] * 5 + [0] * 4])
    c = scaled_dot_product_attention(q, k, v, M.padding(pad), backend="linear")
    ref = linear_attention_reference(q, k, v, key_mask=pad.bool()[:, None, None, :])
    torch.testing.assert_close(c, ref)


def test_linear_is_never_chosen_by_auto_and_refuses_other_masks() -> None:
    q = torch.randn(1, 1, 8, 4)
    why = explain(q, q, q).reasons["linear"]
    assert "approximate" in why and "never by auto" in why
    with pytest.raises(ValueError, match="causal and key-padding"):
        scaled_dot_product_attention(q, q, q, M.sliding_window(2), backend="linear")
    with pytest.raises(ValueError, match="causal and key-padding"):
        scaled_dot_product_attention(q, q, q, torch.ones(8, 8, dtype=torch.bool), backend="linear")


def test_half_precision_and_fully_masked_rows() -> None:
    q = torch.randn(1, 1, 6, 4).bfloat16()
    keep = torch.zeros(1, 1, 1, 6, dtype=torch.bool)
    out = scaled_dot_product_attention(q, q, q, keep, backend="linear")
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.zeros_like(out))
