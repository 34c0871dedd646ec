"""Every form of each recurrence equals its sequential reference, forward and backward.

Selective scan (Mamba), SSD (Mamba-2), WKV (RWKV-4) and retention (RetNet): shapes,
chunk sizes, masks and initial states are drawn by hypothesis; float64 must agree to
1e-10 and float32 to 1e-5.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.functional.retention import (
    retention_chunkwise,
    retention_parallel,
    retention_recurrent,
)
from attnlab.functional.selective_scan import (
    selective_scan_chunked,
    selective_scan_reference,
    selective_scan_step,
)
from attnlab.functional.ssd import segsum, ssd_chunked, ssd_reference
from attnlab.functional.wkv import wkv_chunked, wkv_reference

TOL = {
    torch.float64: {"atol": 1e-10, "rtol": 1e-10},
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
}
DTYPES = st.sampled_from([torch.float32, torch.float64])
SETTINGS = settings(max_examples=15, deadline=None)


# ---------------------------------------------------------------------- selective scan


@st.composite
def scan_case(draw: st.DrawFn) -> dict:
    return {
        "dtype": draw(DTYPES),
        "b": draw(st.integers(1, 3)),
        "l": draw(st.integers(1, 40)),
        "d": draw(st.integers(1, 6)),
        "n": draw(st.integers(1, 5)),
        "chunk": draw(st.integers(1, 17)),
        "masked": draw(st.booleans()),
        "init": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


@SETTINGS
@given(scan_case())
def test_selective_scan_chunked_equals_reference(forms, case: dict) -> None:
    dt, b, l, d, n = case["dtype"], case["b"], case["l"], case["d"], case["n"]
    g = torch.Generator().manual_seed(case["seed"])
    u = torch.randn(b, l, d, generator=g, dtype=dt)
    delta = torch.randn(b, l, d, generator=g, dtype=dt)
    A = -torch.rand(d, n, generator=g, dtype=dt) * 2
    B = torch.randn(b, l, n, generator=g, dtype=dt)
    C = torch.randn(b, l, n, generator=g, dtype=dt)
    D = torch.randn(d, generator=g, dtype=dt)
    z = torch.randn(b, l, d, generator=g, dtype=dt)
    bias = torch.randn(d, generator=g, dtype=dt) * 0.5
    h0 = torch.randn(b, d, n, generator=g, dtype=dt) if case["init"] else None
    mask = forms.left_pad_mask(b, l, g) if case["masked"] else None

    def ref(*xs):
        return selective_scan_reference(
            *xs[:7],
            delta_bias=xs[7],
            delta_softplus=True,
            mask=mask,
            initial_state=h0,
            return_final_state=True,
        )

    def fast(*xs):
        return selective_scan_chunked(
            *xs[:7],
            delta_bias=xs[7],
            delta_softplus=True,
            mask=mask,
            initial_state=h0,
            return_final_state=True,
            chunk_size=case["chunk"],
        )

    forms.assert_equal(ref, fast, [u, delta, A, B, C, D, z, bias], dt, g)


@pytest.mark.parametrize("block", [1, 3, 64])
def test_selective_scan_reverse_backward_passes_gradcheck(monkeypatch, block: int) -> None:
    """The custom backward (functional/ssm_backward.py) against finite differences in
    float64, over blocks of 1, 3 (11 tokens: a partial last block) and one block, with
    the final state's gradient and an initial state."""
    from attnlab.functional import ssm_backward

    monkeypatch.setattr(ssm_backward, "_block", lambda b, d, n, limit: block)
    g = torch.Generator().manual_seed(3)
    b, l, d, n = 2, 11, 3, 4
    f64 = {"generator": g, "dtype": torch.float64}
    xs = [
        torch.rand(b, l, d, **f64) * 0.5,  # delta
        torch.randn(b, l, d, **f64),  # delta * u
        -torch.rand(d, n, **f64) - 0.1,  # A
        torch.randn(b, l, n, **f64),
        torch.randn(b, l, n, **f64),
        torch.randn(b, d, n, **f64),  # h0
    ]
    xs = [x.requires_grad_(True) for x in xs]
    assert torch.autograd.gradcheck(ssm_backward.SelectiveScanFn.apply, xs)


def test_selective_scan_steps_equal_the_scan() -> None:
    g = torch.Generator().manual_seed(0)
    b, l, d, n = 2, 9, 4, 3
    u, delta, z = (torch.randn(b, l, d, generator=g, dtype=torch.float64) for _ in range(3))
    A = -torch.rand(d, n, generator=g, dtype=torch.float64)
    B, C = (torch.randn(b, l, n, generator=g, dtype=torch.float64) for _ in range(2))
    D = torch.randn(d, generator=g, dtype=torch.float64)
    y, last = selective_scan_chunked(
        u, delta, A, B, C, D, z, delta_softplus=True, return_final_state=True, chunk_size=4
    )
    state = torch.zeros(b, d, n, dtype=torch.float64)
    for t in range(l):
        yt, state = selective_scan_step(
            state, u[:, t], delta[:, t], A, B[:, t], C[:, t], D, z[:, t], delta_softplus=True
        )
        torch.testing.assert_close(yt, y[:, t], **TOL[torch.float64])
    torch.testing.assert_close(state, last, **TOL[torch.float64])


def test_selective_scan_left_padding_equals_the_row_alone() -> None:
    g = torch.Generator().manual_seed(1)
    l, d, n, pad = 7, 3, 2, 3
    u, delta = (torch.randn(1, l, d, generator=g, dtype=torch.float64) for _ in range(2))
    A = -torch.rand(d, n, generator=g, dtype=torch.float64)
    B, C = (torch.randn(1, l, n, generator=g, dtype=torch.float64) for _ in range(2))
    alone = selective_scan_reference(u, delta, A, B, C, delta_softplus=True)

    def lp(x: torch.Tensor) -> torch.Tensor:  # garbage in the padding slots
        return torch.cat((torch.randn(1, pad, x.shape[-1], generator=g, dtype=x.dtype), x), 1)

    mask = torch.tensor([[0] * pad + [1] * l])
    for fn in (selective_scan_reference, selective_scan_chunked):
        padded = fn(lp(u), lp(delta), A, lp(B), lp(C), delta_softplus=True, mask=mask)
        torch.testing.assert_close(padded[:, pad:], alone, **TOL[torch.float64])


# ---------------------------------------------------------------------- SSD (Mamba-2)


def test_segsum_matches_its_definition() -> None:
    x = torch.randn(5, dtype=torch.float64)
    out = segsum(x)
    for i in range(5):
        for j in range(5):
            want = x[j + 1 : i + 1].sum() if i >= j else -math.inf
            assert out[i, j].item() == pytest.approx(float(want))


@st.composite
def ssd_case(draw: st.DrawFn) -> dict:
    g = draw(st.integers(1, 2))
    return {
        "dtype": draw(DTYPES),
        "b": draw(st.integers(1, 2)),
        "l": draw(st.integers(1, 40)),
        "g": g,
        "h": g * draw(st.integers(1, 3)),
        "p": draw(st.integers(1, 4)),
        "n": draw(st.integers(1, 4)),
        "chunk": draw(st.integers(1, 17)),
        "masked": draw(st.booleans()),
        "init": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


@SETTINGS
@given(ssd_case())
def test_ssd_chunked_equals_reference(forms, case: dict) -> None:
    dt, b, l, h, p, n, gr = (case[k] for k in ("dtype", "b", "l", "h", "p", "n", "g"))
    g = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(b, l, h, p, generator=g, dtype=dt)
    tstep = torch.randn(b, l, h, generator=g, dtype=dt)
    A = -torch.rand(h, generator=g, dtype=dt) * 2
    B = torch.randn(b, l, gr, n, generator=g, dtype=dt)
    C = torch.randn(b, l, gr, n, generator=g, dtype=dt)
    D = torch.randn(h, generator=g, dtype=dt)
    bias = torch.randn(h, generator=g, dtype=dt) * 0.5
    h0 = torch.randn(b, h, p, n, generator=g, dtype=dt) if case["init"] else None
    mask = forms.left_pad_mask(b, l, g) if case["masked"] else None

    def ref(*xs):
        return ssd_reference(
            *xs[:6],
            dt_bias=xs[6],
            dt_softplus=True,
            mask=mask,
            initial_state=h0,
            return_final_state=True,
        )

    def fast(*xs):
        return ssd_chunked(
            *xs[:6],
            dt_bias=xs[6],
            dt_softplus=True,
            mask=mask,
            initial_state=h0,
            return_final_state=True,
            chunk_size=case["chunk"],
        )

    forms.assert_equal(ref, fast, [x, tstep, A, B, C, D, bias], dt, g)


def test_ssd_is_the_selective_scan_with_a_scalar_A_per_head() -> None:
    """Mamba-2's recurrence is Mamba's with A shared across a head's channels and state."""
    g = torch.Generator().manual_seed(2)
    b, l, h, p, n = 2, 11, 2, 3, 4
    x = torch.randn(b, l, h, p, generator=g, dtype=torch.float64)
    dt = torch.rand(b, l, h, generator=g, dtype=torch.float64)
    A = -torch.rand(h, generator=g, dtype=torch.float64)
    B, C = (torch.randn(b, l, 1, n, generator=g, dtype=torch.float64) for _ in range(2))
    y = ssd_reference(x, dt, A, B, C)
    y6 = selective_scan_reference(
        x.reshape(b, l, h * p),
        dt.repeat_interleave(p, dim=2),
        A.repeat_interleave(p)[:, None].expand(h * p, n),
        B[:, :, 0],
        C[:, :, 0],
    )
    torch.testing.assert_close(y.reshape(b, l, h * p), y6, **TOL[torch.float64])


# ---------------------------------------------------------------------- WKV (RWKV-4)


def _wkv_naive(w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The paper's formula as plain sums (unstable for large keys; float64, small keys)."""
    _, l, _ = k.shape
    decay = torch.exp(w)
    out = []
    for t in range(l):
        num = torch.exp(u + k[:, t]) * v[:, t]
        den = torch.exp(u + k[:, t])
        for s in range(t):
            e = torch.exp(-(t - 1 - s) * decay + k[:, s])
            num, den = num + e * v[:, s], den + e
        out.append(num / den)
    return torch.stack(out, 1)


def test_wkv_reference_equals_the_papers_sums() -> None:
    g = torch.Generator().manual_seed(3)
    b, l, c = 2, 8, 5
    w, u = (torch.randn(c, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(b, l, c, generator=g, dtype=torch.float64) for _ in range(2))
    y, _ = wkv_reference(w, u, k, v)
    torch.testing.assert_close(y, _wkv_naive(w, u, k, v), **TOL[torch.float64])


def test_wkv_is_stable_for_large_keys() -> None:
    k = torch.full((1, 6, 2), 200.0)  # e^200 overflows float32; the stable form does not
    v = torch.randn(1, 6, 2)
    y, state = wkv_reference(torch.zeros(2), torch.zeros(2), k, v)
    assert torch.isfinite(y).all() and all(torch.isfinite(s).all() for s in state)
    y2, _ = wkv_chunked(torch.zeros(2), torch.zeros(2), k, v, chunk_size=4)
    torch.testing.assert_close(y2, y)


@st.composite
def wkv_case(draw: st.DrawFn) -> dict:
    return {
        "dtype": draw(DTYPES),
        "b": draw(st.integers(1, 3)),
        "l": draw(st.integers(1, 40)),
        "c": draw(st.integers(1, 6)),
        "chunk": draw(st.integers(1, 17)),
        "masked": draw(st.booleans()),
        "init": draw(st.booleans()),
        "key_scale": draw(st.sampled_from([1.0, 10.0])),
        "seed": draw(st.integers(0, 2**16)),
    }


@SETTINGS
@given(wkv_case())
def test_wkv_chunked_equals_reference(forms, case: dict) -> None:
    dt, b, l, c = case["dtype"], case["b"], case["l"], case["c"]
    g = torch.Generator().manual_seed(case["seed"])
    w, u = (torch.randn(c, generator=g, dtype=dt) for _ in range(2))
    k = torch.randn(b, l, c, generator=g, dtype=dt) * case["key_scale"]
    v = torch.randn(b, l, c, generator=g, dtype=dt)
    state = None
    if case["init"]:
        _, state = wkv_reference(
            w, u, torch.randn(b, 3, c, generator=g, dtype=dt), v[:, :1].expand(b, 3, c)
        )
    mask = forms.left_pad_mask(b, l, g) if case["masked"] else None

    def ref(w, u, k, v):
        y, s = wkv_reference(w, u, k, v, state=state, mask=mask)
        return (y, *s)

    def fast(w, u, k, v):
        y, s = wkv_chunked(w, u, k, v, state=state, mask=mask, chunk_size=case["chunk"])
        return (y, *s)

    outs_ref, outs_fast = ref(w, u, k, v), fast(w, u, k, v)
    torch.testing.assert_close(outs_fast[0], outs_ref[0], **TOL[dt])
    # states are equal as real sums (num * e^max), not necessarily in their scaling
    for i in (1, 2):
        torch.testing.assert_close(
            outs_fast[i] * torch.exp(outs_fast[3] - outs_ref[3]), outs_ref[i], **TOL[dt]
        )
    weights = [torch.randn(outs_ref[0].shape, generator=g, dtype=dt)]
    for a, b_ in zip(
        forms.grads(lambda *xs: fast(*xs)[:1], [w, u, k, v], weights),
        forms.grads(lambda *xs: ref(*xs)[:1], [w, u, k, v], weights),
    ):
        torch.testing.assert_close(a, b_, **TOL[dt])


# ---------------------------------------------------------------------- retention


@st.composite
def retention_case(draw: st.DrawFn) -> dict:
    return {
        "dtype": draw(DTYPES),
        "b": draw(st.integers(1, 2)),
        "h": draw(st.integers(1, 3)),
        "l": draw(st.integers(1, 40)),
        "dk": draw(st.integers(1, 5)),
        "dv": draw(st.integers(1, 5)),
        "chunk": draw(st.integers(1, 17)),
        "masked": draw(st.booleans()),
        "init": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


@SETTINGS
@given(retention_case())
def test_retention_forms_equal(forms, case: dict) -> None:
    dt, b, h, l, dk, dv = (case[k] for k in ("dtype", "b", "h", "l", "dk", "dv"))
    g = torch.Generator().manual_seed(case["seed"])
    q = torch.randn(b, h, l, dk, generator=g, dtype=dt) / math.sqrt(dk)
    k = torch.randn(b, h, l, dk, generator=g, dtype=dt)
    v = torch.randn(b, h, l, dv, generator=g, dtype=dt)
    gamma = 1 - 2.0 ** (-5 - torch.arange(h, dtype=dt))  # RetNet's decays
    s0 = torch.randn(b, h, dk, dv, generator=g, dtype=dt) if case["init"] else None
    mask = forms.left_pad_mask(b, l, g) if case["masked"] else None

    def rec(q, k, v, gamma):
        return retention_recurrent(q, k, v, gamma, state=s0, mask=mask)

    def par(q, k, v, gamma):
        return retention_parallel(q, k, v, gamma, state=s0, mask=mask)

    def chunk(q, k, v, gamma):
        return retention_chunkwise(q, k, v, gamma, state=s0, mask=mask, chunk_size=case["chunk"])

    forms.assert_equal(rec, par, [q, k, v, gamma], dt, g)
    forms.assert_equal(rec, chunk, [q, k, v, gamma], dt, g)


def test_retention_is_the_papers_decayed_sum() -> None:
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 6, 3, generator=g, dtype=torch.float64) for _ in range(3))
    gamma = torch.tensor([0.9, 0.5], dtype=torch.float64)
    o, _ = retention_parallel(q, k, v, gamma)
    for hh in range(2):
        for n in range(6):
            want = sum(
                gamma[hh] ** (n - m) * (q[0, hh, n] @ k[0, hh, m]) * v[0, hh, m]
                for m in range(n + 1)
            )
            torch.testing.assert_close(o[0, hh, n], want, **TOL[torch.float64])


def test_retention_left_padding_equals_the_row_alone() -> None:
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 5, 3, generator=g, dtype=torch.float64) for _ in range(3))
    gamma = torch.tensor([0.9, 0.7], dtype=torch.float64)
    alone, s_alone = retention_recurrent(q, k, v, gamma)
    pad = torch.randn(1, 2, 4, 3, generator=g, dtype=torch.float64)
    mask = torch.tensor([[0] * 4 + [1] * 5])
    for fn in (retention_recurrent, retention_parallel, retention_chunkwise):
        o, s = fn(*(torch.cat((pad, x), 2) for x in (q, k, v)), gamma, mask=mask)
        torch.testing.assert_close(o[:, :, 4:], alone, **TOL[torch.float64])
        torch.testing.assert_close(s, s_alone, **TOL[torch.float64])


# ---------------------------------------------------------------------- bad inputs


def test_bad_inputs_are_named() -> None:
    u = torch.randn(1, 4, 3)
    A = -torch.rand(3, 2)
    B = C = torch.randn(1, 4, 2)
    with pytest.raises(ValueError, match="initial_state"):
        selective_scan_reference(u, u, A, B, C, initial_state=torch.zeros(1, 3, 5))
    with pytest.raises(ValueError, match="chunk_size"):
        selective_scan_chunked(u, u, A, B, C, chunk_size=0)
    with pytest.raises(ValueError, match="chunk_size"):
        ssd_chunked(
            torch.randn(1, 4, 2, 3),
            torch.rand(1, 4, 2),
            -torch.rand(2),
            torch.randn(1, 4, 1, 2),
            torch.randn(1, 4, 1, 2),
            chunk_size=2.5,
        )  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="divisible"):
        ssd_reference(
            torch.randn(1, 4, 3, 3),
            torch.rand(1, 4, 3),
            -torch.rand(3),
            torch.randn(1, 4, 2, 2),
            torch.randn(1, 4, 2, 2),
        )
    with pytest.raises(ValueError, match="state"):
        wkv_reference(torch.zeros(3), torch.zeros(3), u, u, state=(torch.zeros(1, 3),) * 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gamma"):
        retention_parallel(*(torch.randn(1, 2, 4, 3),) * 3, torch.tensor([0.5, 1.5]))
    with pytest.raises(ValueError, match=r"state must be .*\(1, 2, 3, 3\)"):
        retention_chunkwise(
            *(torch.randn(1, 2, 4, 3),) * 3, torch.tensor([0.5, 0.9]), state=torch.zeros(1, 2, 3)
        )
    with pytest.raises(ValueError, match="mask"):
        retention_recurrent(
            *(torch.randn(1, 2, 4, 3),) * 3, torch.tensor([0.5, 0.9]), mask=torch.ones(1, 5)
        )
    with pytest.raises(TypeError, match="floating"):
        selective_scan_reference(u.long(), u, A, B, C)
