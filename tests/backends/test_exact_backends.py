"""Every exact block-wise backend equals the reference, forward and backward.

Hypothesis draws the shapes (batch, GQA head ratios, lengths, head dims), the mask
(every pattern and combinations of them, dense bool/float masks, ``is_causal``),
the dtype and the tile sizes, so that tiles are skipped, full, partial and ragged,
and rows are fully masked. Each backend's output and its gradients with respect to
query, key and value are compared with :func:`attnlab.functional.sdpa_reference`.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnlab import scaled_dot_product_attention
from attnlab.backends.sparse import sparse_attention
from attnlab.backends.tiled import tiled_attention
from attnlab.functional import masks as M
from attnlab.functional import sdpa_reference
from attnlab.functional.score_mods import alibi, softcap


def budget(n: int) -> settings:
    """Hypothesis settings: ``n`` derandomized examples, no deadline (CPU time varies)."""
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


TOL = {
    torch.float64: {"atol": 1e-10, "rtol": 1e-8},
    torch.float32: {"atol": 2e-5, "rtol": 1e-4},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}


def _documents(draw: st.DrawFn, n: int, batch: int | None) -> M.MaskPattern:
    def one() -> list[int]:
        ids: list[int] = []
        doc = 0
        while len(ids) < n:
            ids += [doc] * draw(st.integers(1, max(1, n // 2)))
            doc += 1
        return ids[:n]

    if batch is None:
        return M.document(one())
    return M.document(torch.tensor([one() for _ in range(batch)]))


@st.composite
def base_patterns(draw: st.DrawFn, n: int, batch: int) -> M.MaskPattern:
    kind = draw(
        st.sampled_from(
            [
                "causal",
                "full",
                "window",
                "global",
                "dilated",
                "document",
                "document_b",
                "prefix",
                "padding",
            ]
        )
    )
    if kind == "causal":
        return M.causal()
    if kind == "full":
        return M.full()
    if kind == "window":
        return M.sliding_window(draw(st.integers(0, n)), draw(st.integers(0, 6)))
    if kind == "global":
        return M.global_tokens(draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=3)))
    if kind == "dilated":
        return M.dilated(
            draw(st.integers(0, 4)), draw(st.integers(1, 3)), causal=draw(st.booleans())
        )
    if kind == "document":
        return _documents(draw, n, None)
    if kind == "document_b":
        return _documents(draw, n, batch)
    if kind == "prefix":
        return M.prefix_lm(draw(st.integers(0, n)))
    keep = draw(
        st.lists(st.lists(st.booleans(), min_size=n, max_size=n), min_size=batch, max_size=batch)
    )
    return M.padding(torch.tensor(keep, dtype=torch.long))


@st.composite
def patterns(draw: st.DrawFn, n: int, batch: int) -> M.MaskPattern:
    p = draw(base_patterns(n, batch))
    for _ in range(draw(st.integers(0, 2))):
        op = draw(st.sampled_from(["&", "|", "~"]))
        if op == "~":
            p = ~p
        else:
            other = draw(base_patterns(n, batch))
            p = (p & other) if op == "&" else (p | other)
    return p


@st.composite
def cases(draw: st.DrawFn, dense: bool = False) -> dict:
    batch = draw(st.integers(1, 2))
    h_kv = draw(st.integers(1, 2))
    heads = h_kv * draw(st.sampled_from([1, 2, 3]))
    L = draw(st.integers(1, 24))
    S = draw(st.integers(1, 24))
    E = draw(st.sampled_from([4, 8]))
    Ev = draw(st.sampled_from([4, 6]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    mask: torch.Tensor | M.MaskPattern | None
    if dense:
        kind = draw(st.sampled_from(["bool", "float", "key_padding"]))
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
        if kind == "key_padding":
            mask = torch.rand(batch, 1, 1, S, generator=g) > 0.4
        elif kind == "bool":
            mask = torch.rand(batch, draw(st.sampled_from([1, heads])), L, S, generator=g) > 0.5
        else:
            mask = torch.randn(1, heads, L, S, generator=g, dtype=dtype)
            mask = mask.masked_fill(torch.rand(L, S, generator=g) > 0.7, float("-inf"))
    else:
        mask = draw(st.one_of(st.none(), patterns(max(L, S), batch)))
        mods = draw(st.sampled_from([(), ("alibi",), ("softcap",), ("alibi", "softcap")]))
        if mods:
            chosen = [alibi(heads) if m == "alibi" else softcap(1.5) for m in mods]
            mask = (mask or M.full()).with_scores(*chosen)
    return {
        "shape": (batch, heads, h_kv, L, S, E, Ev),
        "dtype": dtype,
        "mask": mask,
        "is_causal": draw(st.booleans()),
        "scale": draw(st.sampled_from([None, 0.3])),
        "block_q": draw(st.sampled_from([1, 3, 4, 8, 32])),
        "block_k": draw(st.sampled_from([1, 2, 5, 8, 32])),
        # 1: every key block in its own online-softmax step; 4096: merged spans
        "max_span": draw(st.sampled_from([1, 1, 10, 4096])),
        "seed": draw(st.integers(0, 2**16)),
    }


def _inputs(case: dict, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    batch, heads, h_kv, L, S, E, Ev = case["shape"]
    g = torch.Generator().manual_seed(case["seed"])
    dt = dtype or case["dtype"]
    q = torch.randn(batch, heads, L, E, generator=g).to(dt).requires_grad_()
    k = torch.randn(batch, h_kv, S, E, generator=g).to(dt).requires_grad_()
    v = torch.randn(batch, h_kv, S, Ev, generator=g).to(dt).requires_grad_()
    return q, k, v


def _reference(case: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    mask = case["mask"]
    L, S = q.shape[-2], k.shape[-2]
    dense = mask.to_dense(L, S) if isinstance(mask, M.MaskPattern) else mask
    mods = mask.score_mods if isinstance(mask, M.MaskPattern) else ()
    out, _ = sdpa_reference(
        q,
        k,
        v,
        dense,
        is_causal=case["is_causal"],
        scale=case["scale"],
        enable_gqa=True,
        score_mods=mods,
    )
    return out


def _compare(case: dict, run, dtype: torch.dtype | None = None) -> None:  # type: ignore[no-untyped-def]
    q, k, v = _inputs(case, dtype)
    out = run(q, k, v)
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = _reference(case, qr, kr, vr)
    tol = TOL[q.dtype]
    torch.testing.assert_close(out, ref, **tol)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (qr, kr, vr), grad)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, n=name: f"d{n}: {m}")


@budget(260)
@given(case=cases())
def test_tiled_equals_reference_on_patterns(case: dict) -> None:
    _compare(
        case,
        lambda q, k, v: tiled_attention(
            q,
            k,
            v,
            case["mask"],
            0.0,
            case["is_causal"],
            case["scale"],
            True,
            block_q=case["block_q"],
            block_k=case["block_k"],
            max_span=case["max_span"],
        )[0],
    )


@budget(120)
@given(case=cases(dense=True))
def test_tiled_equals_reference_on_dense_masks(case: dict) -> None:
    _compare(
        case,
        lambda q, k, v: tiled_attention(
            q,
            k,
            v,
            case["mask"],
            0.0,
            case["is_causal"],
            case["scale"],
            True,
            block_q=case["block_q"],
            block_k=case["block_k"],
            max_span=case["max_span"],
        )[0],
    )


@budget(200)
@given(case=cases())
def test_sparse_equals_reference(case: dict) -> None:
    _compare(
        case,
        lambda q, k, v: sparse_attention(
            q,
            k,
            v,
            case["mask"],
            0.0,
            case["is_causal"],
            case["scale"],
            True,
            block=case["block_k"],
        )[0],
    )


@budget(40)
@given(case=cases(), backend=st.sampled_from(["tiled", "sparse"]))
def test_bfloat16_within_looser_tolerance(case: dict, backend: str) -> None:
    """bfloat16 inputs: softmax in float32, compared with the float32 reference."""
    q, k, v = _inputs(case, torch.bfloat16)
    out = scaled_dot_product_attention(
        q,
        k,
        v,
        case["mask"],
        is_causal=case["is_causal"],
        scale=case["scale"],
        enable_gqa=True,
        backend=backend,
    )
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    ref = _reference(case, *(t.detach().float() for t in (q, k, v)))
    torch.testing.assert_close(out.float(), ref, **TOL[torch.bfloat16])


@budget(60)
@given(case=cases(), backend=st.sampled_from(["tiled", "sparse", "sdpa"]))
def test_weights_recomputed_from_lse(case: dict, backend: str) -> None:
    mask = case["mask"]
    if backend == "sdpa" and isinstance(mask, M.MaskPattern) and mask.score_mods:
        backend = "tiled"  # torch's kernel cannot apply score modifiers
    q, k, v = (t.detach() for t in _inputs(case))
    out, w = scaled_dot_product_attention(
        q,
        k,
        v,
        case["mask"],
        is_causal=case["is_causal"],
        scale=case["scale"],
        enable_gqa=True,
        backend=backend,
        return_weights=True,
    )
    mask = case["mask"]
    dense = mask.to_dense(q.shape[-2], k.shape[-2]) if isinstance(mask, M.MaskPattern) else mask
    ref, ref_w = sdpa_reference(
        q,
        k,
        v,
        dense,
        score_mods=mask.score_mods if isinstance(mask, M.MaskPattern) else (),
        is_causal=case["is_causal"],
        scale=case["scale"],
        enable_gqa=True,
        return_weights=True,
    )
    torch.testing.assert_close(out, ref, **TOL[q.dtype])
    assert ref_w is not None
    torch.testing.assert_close(w, ref_w, **TOL[q.dtype])


def test_fully_masked_rows_are_zero_with_zero_grad() -> None:
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    pattern = M.sliding_window(0) & ~M.causal()  # nothing is attended
    for run in (
        lambda: tiled_attention(q, k, v, pattern, block_q=2, block_k=2)[0],
        lambda: sparse_attention(q, k, v, pattern, block=2)[0],
    ):
        out = run()
        assert torch.equal(out, torch.zeros_like(out))
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_leading_batch_dims_and_3d_inputs() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 2, 7, 4, generator=g) for _ in range(3))
    ref, _ = sdpa_reference(q, k, v, is_causal=True)
    for backend in ("tiled", "sparse"):
        out = scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend)
        torch.testing.assert_close(out, ref)
    q3, k3, v3 = (torch.randn(3, 7, 4, generator=g) for _ in range(3))
    ref3, _ = sdpa_reference(q3, k3, v3, M.sliding_window(2).to_dense(7, 7))
    for backend in ("tiled", "sparse"):
        out3 = scaled_dot_product_attention(q3, k3, v3, M.sliding_window(2), backend=backend)
        torch.testing.assert_close(out3, ref3)


@pytest.mark.parametrize("backend", ["tiled", "sparse"])
def test_dropout_is_refused_by_name(backend: str) -> None:
    q = torch.randn(1, 1, 4, 4)
    with pytest.raises(ValueError, match="dropout"):
        scaled_dot_product_attention(q, q, q, dropout_p=0.1, backend=backend)


def test_batch_size_mismatch_names_the_sizes() -> None:
    q = torch.randn(3, 1, 4, 4)
    pattern = M.padding(torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="batch size 2"):
        scaled_dot_product_attention(q, q, q, pattern, backend="tiled")
