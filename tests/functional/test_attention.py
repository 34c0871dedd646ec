"""The reference attention against torch's kernel, and attnlab's deliberate differences."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import scaled_dot_product_attention as sdpa
from attnlab.functional import sdpa_reference

TOL = {
    torch.float64: {"atol": 1e-10, "rtol": 1e-10},
    torch.float32: {"atol": 2e-5, "rtol": 1e-4},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}


@st.composite
def attention_case(draw: st.DrawFn) -> dict:
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    b = draw(st.integers(1, 3))
    h_kv = draw(st.integers(1, 3))
    groups = draw(st.integers(1, 3))
    h = h_kv * groups
    L = draw(st.integers(1, 9))
    S = draw(st.integers(1, 9))
    e = draw(st.sampled_from([1, 4, 8, 16]))
    ev = draw(st.sampled_from([e, 3, 8]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, L, e, generator=g, dtype=dtype)
    k = torch.randn(b, h_kv, S, e, generator=g, dtype=dtype)
    v = torch.randn(b, h_kv, S, ev, generator=g, dtype=dtype)
    mask_kind = draw(st.sampled_from(["none", "bool", "float", "bool_bcast"]))
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(b, h, L, S, generator=g) > 0.3
        mask[..., 0] = True  # torch gives NaN on fully masked rows; keep at least one key
    elif mask_kind == "bool_bcast":
        mask = torch.rand(1, 1, L, S, generator=g) > 0.3
        mask[..., 0] = True
    elif mask_kind == "float":
        mask = torch.randn(b, 1, L, S, generator=g, dtype=dtype)
    is_causal = draw(st.booleans()) and mask is None
    scale = draw(st.sampled_from([None, 0.5, 1.0 / 3]))
    return {
        "q": q,
        "k": k,
        "v": v,
        "mask": mask,
        "is_causal": is_causal,
        "scale": scale,
        "gqa": h != h_kv,
    }


@settings(max_examples=150)
@given(attention_case())
def test_reference_matches_torch(case: dict) -> None:
    args = (case["q"], case["k"], case["v"])
    kw = {"is_causal": case["is_causal"], "scale": case["scale"], "enable_gqa": case["gqa"]}
    expected = F.scaled_dot_product_attention(*args, attn_mask=case["mask"], **kw)
    out, w = sdpa(*args, case["mask"], backend="reference", return_weights=True, **kw)
    torch.testing.assert_close(out, expected, **TOL[out.dtype])
    torch.testing.assert_close(w.sum(-1), torch.ones_like(w.sum(-1)), **TOL[w.dtype])


@settings(max_examples=60)
@given(attention_case())
def test_auto_matches_reference(case: dict) -> None:
    args = (case["q"], case["k"], case["v"])
    kw = {"is_causal": case["is_causal"], "scale": case["scale"], "enable_gqa": case["gqa"]}
    ref = sdpa(*args, case["mask"], backend="reference", **kw)
    torch.testing.assert_close(sdpa(*args, case["mask"], **kw), ref, **TOL[ref.dtype])


@settings(max_examples=40)
@given(attention_case())
def test_gradients_match_torch(case: dict) -> None:
    q, k, v = (t.clone().requires_grad_() for t in (case["q"], case["k"], case["v"]))
    kw = {"is_causal": case["is_causal"], "scale": case["scale"], "enable_gqa": case["gqa"]}
    ours = sdpa(q, k, v, case["mask"], backend="reference", **kw)
    got = torch.autograd.grad(ours.sum(), (q, k, v))
    q2, k2, v2 = (t.clone().requires_grad_() for t in (case["q"], case["k"], case["v"]))
    theirs = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=case["mask"], **kw)
    want = torch.autograd.grad(theirs.sum(), (q2, k2, v2))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL[a.dtype])


def _float64_truth(q, k, v, mask=None):
    s = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v.double()


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_fully_masked_rows_give_zeros_not_nan(backend: str) -> None:
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 4)
    mask = torch.rand(2, 3, 5, 6) > 0.4
    mask[..., 0] = True
    mask[0, 1, 2] = False  # one fully masked row
    mask[1, :, 4] = False  # fully masked in every head
    torch_out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    # torch gives NaN or zeros here depending on the kernel it picks; attnlab always zeros.
    out = sdpa(q, k, v, mask, backend=backend)
    assert torch.isfinite(out).all()
    assert (out[0, 1, 2] == 0).all() and (out[1, :, 4] == 0).all()
    ok = mask.any(-1)
    torch.testing.assert_close(out[ok], torch_out[ok])
    if backend == "reference":
        _, w = sdpa(q, k, v, mask, backend=backend, return_weights=True)
        assert (w[0, 1, 2] == 0).all()


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_fully_masked_rows_have_finite_gradients(backend: str) -> None:
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    mask = torch.ones(1, 2, 4, 4, dtype=torch.bool)
    mask[0, 0, 1] = False
    additive = torch.zeros(1, 2, 4, 4).masked_fill(~mask, float("-inf"))
    for m in (mask, additive):
        out = sdpa(q, k, v, m, backend=backend)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        assert all(torch.isfinite(g).all() for g in grads)
        assert (grads[0][0, 0, 1] == 0).all()  # the blanked query row gets no gradient


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_half_precision_is_stable(dtype: torch.dtype, backend: str) -> None:
    # Scores reach ~1e5 here: fp16 would overflow (max 65504) without float32 softmax.
    q = torch.randn(2, 2, 16, 64) * 40
    k = torch.randn(2, 2, 16, 64) * 40
    v = torch.randn(2, 2, 16, 64)
    mask = torch.rand(2, 1, 16, 16) > 0.5
    mask[..., 0] = True
    out = sdpa(q.to(dtype), k.to(dtype), v.to(dtype), mask, backend=backend)
    assert out.dtype == dtype and torch.isfinite(out).all()
    # compare against float64 math on the same (rounded) inputs
    truth = _float64_truth(q.to(dtype), k.to(dtype), v.to(dtype), mask)
    torch.testing.assert_close(out.double(), truth, **TOL[dtype])


def test_half_reference_weights_sum_to_one() -> None:
    q = (torch.randn(1, 1, 8, 32) * 100).half()
    _, w = sdpa(q, q, q, backend="reference", return_weights=True)
    torch.testing.assert_close(w.float().sum(-1), torch.ones(1, 1, 8), atol=5e-3, rtol=0)


def test_mask_and_causal_together_intersect() -> None:
    q, k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    mask = torch.rand(5, 5) > 0.5
    both = mask & torch.ones(5, 5, dtype=torch.bool).tril()
    for backend in ("reference", "auto"):
        got = sdpa(q, k, v, mask, is_causal=True, backend=backend)
        torch.testing.assert_close(got, sdpa(q, k, v, both, backend="reference"))


def test_three_dim_inputs_and_extra_batch_dims() -> None:
    q, k, v = torch.randn(3, 5, 8), torch.randn(3, 7, 8), torch.randn(3, 7, 8)
    torch.testing.assert_close(sdpa(q, k, v), F.scaled_dot_product_attention(q, k, v))
    q5 = torch.randn(2, 2, 3, 5, 8)
    torch.testing.assert_close(
        sdpa(q5, q5, q5, backend="reference"), F.scaled_dot_product_attention(q5, q5, q5)
    )


def test_dropout_is_applied_and_reproducible() -> None:
    q = torch.randn(1, 1, 6, 8)
    torch.manual_seed(1)
    a = sdpa(q, q, q, dropout_p=0.5, backend="reference")
    torch.manual_seed(1)
    b = sdpa(q, q, q, dropout_p=0.5, backend="reference")
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, sdpa(q, q, q))


def test_weights_are_the_softmax_of_scaled_scores() -> None:
    q, k, v = (
        torch.randn(1, 2, 3, 4, dtype=torch.float64),
        torch.randn(1, 2, 5, 4),
        torch.randn(1, 2, 5, 4),
    )
    k, v = k.double(), v.double()
    _, w = sdpa(q, k, v, scale=0.7, backend="reference", return_weights=True)
    torch.testing.assert_close(w, torch.softmax(q @ k.transpose(-2, -1) * 0.7, -1))


def test_sdpa_reference_is_float64_capable() -> None:
    q = torch.randn(2, 2, 4, 8, dtype=torch.float64)
    out, _ = sdpa_reference(q, q, q)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, _float64_truth(q, q, q), atol=1e-12, rtol=1e-12)
