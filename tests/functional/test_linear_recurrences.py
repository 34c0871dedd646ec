"""The delta rule (DeltaNet, Gated DeltaNet), GLA, RWKV-7's generalized delta rule, the
RG-LRU's linear recurrence and the short convolution: every form equals the reference,
forward and backward, at every length.

Shapes, chunk sizes (including ones that do not divide the length, and length 1), masks
and initial states are drawn by hypothesis; float64 must agree to 1e-10 and float32 to
1e-5. The references are checked against the papers' equations written independently
(transition matrices, double sums) and, for the gated delta rule, against transformers'
own Qwen3-Next implementation.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.functional.delta_rule import delta_rule_chunked, delta_rule_reference, delta_rule_step
from attnlab.functional.gla import gla_chunked, gla_reference, gla_step
from attnlab.functional.rglru import (
    linear_recurrence_reference,
    linear_recurrence_scan,
    rglru_coefficients,
)
from attnlab.functional.rwkv7 import rwkv7_chunked, rwkv7_reference, rwkv7_step
from attnlab.functional.short_conv import short_conv, short_conv_reference, short_conv_step

TOL = {
    torch.float64: {"atol": 1e-10, "rtol": 1e-10},
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
}
DTYPES = st.sampled_from([torch.float32, torch.float64])
SETTINGS = settings(max_examples=12, deadline=None)
F64 = torch.float64


@st.composite
def case(draw: st.DrawFn) -> dict:
    return {
        "dtype": draw(DTYPES),
        "b": draw(st.integers(1, 2)),
        "h": draw(st.integers(1, 3)),
        "l": draw(st.integers(1, 40)),
        "dk": draw(st.integers(1, 6)),
        "dv": draw(st.integers(1, 5)),
        "chunk": draw(st.sampled_from([1, 2, 3, 5, 8, 16, 17, 32, 48, 64])),
        "masked": draw(st.booleans()),
        "init": draw(st.booleans()),
        "gated": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def _qkv(c: dict, g: torch.Generator, forms):
    b, h, l, dk, dv, dt = c["b"], c["h"], c["l"], c["dk"], c["dv"], c["dtype"]
    q = torch.randn(b, h, l, dk, generator=g, dtype=dt)
    k = F.normalize(torch.randn(b, h, l, dk, generator=g, dtype=dt), dim=-1)
    v = torch.randn(b, h, l, dv, generator=g, dtype=dt)
    s0 = torch.randn(b, h, dk, dv, generator=g, dtype=dt) if c["init"] else None
    mask = forms.left_pad_mask(b, l, g) if c["masked"] else None
    return q, k, v, s0, mask


# ---------------------------------------------------------------------- delta rule


@SETTINGS
@given(case())
def test_delta_rule_chunked_equals_reference(forms, c: dict) -> None:
    g = torch.Generator().manual_seed(c["seed"])
    q, k, v, s0, mask = _qkv(c, g, forms)
    b, h, l, dt = c["b"], c["h"], c["l"], c["dtype"]
    beta = torch.rand(b, h, l, generator=g, dtype=dt)
    gate = -torch.rand(b, h, l, generator=g, dtype=dt) * 2
    inputs = [q, k, v, beta] + ([gate] if c["gated"] else [])

    def ref(*xs):
        return delta_rule_reference(*xs[:4], g=xs[4] if c["gated"] else None, state=s0, mask=mask)

    def fast(*xs):
        gk = xs[4] if c["gated"] else None
        return delta_rule_chunked(*xs[:4], g=gk, state=s0, mask=mask, chunk_size=c["chunk"])

    forms.assert_equal(ref, fast, inputs, dt, g)


def _delta_rule_papers(q, k, v, beta, alpha, s0):
    """Yang et al. (2025) eq. 10 with explicit matrices: ``S_t = S_{t-1} alpha_t (I - beta_t k_t k_t^T)
    + beta_t v_t k_t^T`` on ``S [V, K]``, ``o_t = S_t q_t / sqrt(K)``, one head at a time."""
    b, h, l, dk = q.shape
    out = torch.zeros(b, h, l, v.shape[-1], dtype=F64)
    for bi in range(b):
        for hi in range(h):
            S = s0[bi, hi].T.clone()
            for t in range(l):
                kt, vt, bt = k[bi, hi, t], v[bi, hi, t], beta[bi, hi, t]
                trans = alpha[bi, hi, t] * (torch.eye(dk, dtype=F64) - bt * torch.outer(kt, kt))
                S = S @ trans + bt * torch.outer(vt, kt)
                out[bi, hi, t] = S @ q[bi, hi, t] / dk**0.5
    return out


def test_delta_rule_reference_is_the_papers_transition() -> None:
    g = torch.Generator().manual_seed(0)
    b, h, l, dk, dv = 2, 2, 9, 4, 3
    q = torch.randn(b, h, l, dk, generator=g, dtype=F64)
    k = F.normalize(torch.randn(b, h, l, dk, generator=g, dtype=F64), dim=-1)
    v = torch.randn(b, h, l, dv, generator=g, dtype=F64)
    beta = torch.rand(b, h, l, generator=g, dtype=F64)
    gate = -torch.rand(b, h, l, generator=g, dtype=F64)
    s0 = torch.randn(b, h, dk, dv, generator=g, dtype=F64)
    o, _ = delta_rule_reference(q, k, v, beta, g=gate, state=s0)
    torch.testing.assert_close(o, _delta_rule_papers(q, k, v, beta, gate.exp(), s0), **TOL[F64])
    o0, _ = delta_rule_reference(q, k, v, beta, state=s0)  # DeltaNet: alpha = 1
    ones = torch.ones_like(beta)
    torch.testing.assert_close(o0, _delta_rule_papers(q, k, v, beta, ones, s0), **TOL[F64])


@pytest.mark.parametrize("l", [1, 7, 64, 100])
def test_gated_delta_rule_equals_transformers_qwen3_next(l: int) -> None:
    qn = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    g = torch.Generator().manual_seed(l)
    b, h, dk, dv = 2, 3, 8, 5
    q, k = (torch.randn(b, h, l, dk, generator=g) for _ in range(2))
    v = torch.randn(b, h, l, dv, generator=g)
    beta = torch.rand(b, h, l, generator=g)
    gate = -torch.rand(b, h, l, generator=g)
    s0 = torch.randn(b, h, dk, dv, generator=g)

    def hf(x: torch.Tensor) -> torch.Tensor:  # [B, H, L, ...] -> transformers' [B, L, H, ...]
        return x.transpose(1, 2)

    args = (hf(q), hf(k), hf(v))
    kw = dict(g=hf(gate), beta=hf(beta), initial_state=s0, output_final_state=True)
    want, want_s = qn.torch_chunk_gated_delta_rule(*args, **kw, use_qk_l2norm_in_kernel=True)
    qn_, kn_ = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    for fn in (delta_rule_reference, delta_rule_chunked):
        o, s = fn(qn_, kn_, v, beta, g=gate, state=s0)
        torch.testing.assert_close(o, hf(want), atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(s, want_s, atol=2e-5, rtol=2e-5)


def test_delta_rule_steps_and_padding() -> None:
    g = torch.Generator().manual_seed(1)
    b, h, l, dk, dv, pad = 1, 2, 11, 4, 3, 4
    q, k = (torch.randn(b, h, l, dk, generator=g, dtype=F64) for _ in range(2))
    k = F.normalize(k, dim=-1)
    v = torch.randn(b, h, l, dv, generator=g, dtype=F64)
    beta, gate = (
        torch.rand(b, h, l, generator=g, dtype=F64),
        -torch.rand(b, h, l, generator=g, dtype=F64),
    )
    o, last = delta_rule_chunked(q, k, v, beta, g=gate, chunk_size=4)
    s = torch.zeros(b, h, dk, dv, dtype=F64)
    for t in range(l):
        ot, s = delta_rule_step(
            q[:, :, t], k[:, :, t], v[:, :, t], beta[:, :, t], s, g=gate[:, :, t]
        )
        torch.testing.assert_close(ot, o[:, :, t], **TOL[F64])
    torch.testing.assert_close(s, last, **TOL[F64])

    def lp(x: torch.Tensor) -> torch.Tensor:  # garbage in the padding slots
        junk = torch.randn(*x.shape[:2], pad, *x.shape[3:], generator=g, dtype=x.dtype)
        return torch.cat((junk, x), 2)

    mask = torch.tensor([[0] * pad + [1] * l])
    for fn in (delta_rule_reference, delta_rule_chunked):
        padded, s_pad = fn(lp(q), lp(k), lp(v), lp(beta), g=lp(gate), mask=mask)
        torch.testing.assert_close(padded[:, :, pad:], o, **TOL[F64])
        torch.testing.assert_close(s_pad, last, **TOL[F64])


def test_delta_rule_rejects_bad_inputs() -> None:
    q = torch.randn(1, 2, 5, 4)
    v = torch.randn(1, 2, 5, 3)
    with pytest.raises(ValueError, match="beta must be"):
        delta_rule_chunked(q, q, v, torch.rand(1, 2, 4))
    with pytest.raises(ValueError, match="state must be"):
        delta_rule_reference(q, q, v, torch.rand(1, 2, 5), state=torch.zeros(1, 2, 3, 3))
    with pytest.raises(ValueError, match="chunk_size"):
        delta_rule_chunked(q, q, v, torch.rand(1, 2, 5), chunk_size=0)
    with pytest.raises(ValueError, match="scale"):
        delta_rule_chunked(q, q, v, torch.rand(1, 2, 5), scale=-1.0)
    with pytest.raises(TypeError, match="floating"):
        delta_rule_chunked(q.long(), q, v, torch.rand(1, 2, 5))


# ---------------------------------------------------------------------- GLA


@SETTINGS
@given(case())
def test_gla_chunked_equals_reference(forms, c: dict) -> None:
    g = torch.Generator().manual_seed(c["seed"])
    q, k, v, s0, mask = _qkv(c, g, forms)
    k = k * 2  # GLA does not normalise its keys
    # strong decays too: the chunked form must stay exact when e^{-b} would overflow
    scale = 40.0 if c["gated"] else 1.0
    gk = -torch.rand(q.shape, generator=g, dtype=c["dtype"]) * scale

    def ref(*xs):
        return gla_reference(*xs, state=s0, mask=mask)

    def fast(*xs):
        return gla_chunked(*xs, state=s0, mask=mask, chunk_size=c["chunk"])

    forms.assert_equal(ref, fast, [q, k, v, gk], c["dtype"], g)


def test_gla_reference_is_the_papers_double_sum() -> None:
    """``o_t = sum_{s<=t} (q_t . (prod_{r=s+1..t} alpha_r * k_s)) v_s / sqrt(K)`` (eq. 3 unrolled)."""
    g = torch.Generator().manual_seed(2)
    b, h, l, dk, dv = 1, 2, 8, 3, 2
    q, k = (torch.randn(b, h, l, dk, generator=g, dtype=F64) for _ in range(2))
    v = torch.randn(b, h, l, dv, generator=g, dtype=F64)
    gk = -torch.rand(b, h, l, dk, generator=g, dtype=F64)
    want = torch.zeros(b, h, l, dv, dtype=F64)
    for t in range(l):
        for s in range(t + 1):
            decay = gk[:, :, s + 1 : t + 1].sum(2).exp()  # [B, H, K]
            w = (q[:, :, t] * decay * k[:, :, s]).sum(-1, keepdim=True) / dk**0.5
            want[:, :, t] += w * v[:, :, s]
    o, last = gla_reference(q, k, v, gk)
    torch.testing.assert_close(o, want, **TOL[F64])
    s = torch.zeros(b, h, dk, dv, dtype=F64)
    for t in range(l):
        ot, s = gla_step(q[:, :, t], k[:, :, t], v[:, :, t], gk[:, :, t], s)
        torch.testing.assert_close(ot, o[:, :, t], **TOL[F64])
    torch.testing.assert_close(s, last, **TOL[F64])


def test_gla_rejects_bad_inputs() -> None:
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match="gk must be"):
        gla_chunked(q, q, q, torch.zeros(1, 2, 5, 3))
    with pytest.raises(ValueError, match="mask must be"):
        gla_chunked(q, q, q, q, mask=torch.ones(1, 4))


# ---------------------------------------------------------------------- RG-LRU, short conv


@SETTINGS
@given(case())
def test_linear_recurrence_scan_equals_reference(forms, c: dict) -> None:
    g = torch.Generator().manual_seed(c["seed"])
    b, l, d, dt = c["b"], c["l"], c["dk"], c["dtype"]
    a = torch.rand(b, l, d, generator=g, dtype=dt) ** (8.0 if c["gated"] else 0.2)
    u = torch.randn(b, l, d, generator=g, dtype=dt)
    h0 = torch.randn(b, d, generator=g, dtype=dt) if c["init"] else None

    def ref(a_, u_):
        return linear_recurrence_reference(a_, u_, state=h0)

    def fast(a_, u_):
        return linear_recurrence_scan(a_, u_, state=h0, chunk_size=c["chunk"])

    forms.assert_equal(ref, fast, [a, u], dt, g)


def test_rglru_coefficients_are_griffins() -> None:
    """``a = exp(-8 r softplus(L))``, ``u = sqrt(1 - a^2) i x``; a reset token: ``a = 0``, ``u = i x``;
    padding: ``a = 1``, ``u = 0``."""
    g = torch.Generator().manual_seed(3)
    b, l, d = 2, 5, 4
    x, ig, rg = (torch.rand(b, l, d, generator=g, dtype=F64) for _ in range(3))
    lam = torch.randn(d, generator=g, dtype=F64)
    reset = torch.zeros(b, l, dtype=torch.bool)
    reset[:, 0] = True
    mask = torch.ones(b, l)
    mask[1, 0] = 0
    a, u = rglru_coefficients(x, ig, rg, lam, reset=reset, mask=mask)
    want_a = torch.exp(-8 * rg * F.softplus(lam))
    want_u = torch.sqrt(1 - want_a**2) * ig * x
    torch.testing.assert_close(a[0, 1:], want_a[0, 1:], **TOL[F64])
    torch.testing.assert_close(u[0, 1:], want_u[0, 1:], **TOL[F64])
    torch.testing.assert_close(a[0, 0], torch.zeros(d, dtype=F64))
    torch.testing.assert_close(u[0, 0], (ig * x)[0, 0])
    torch.testing.assert_close(a[1, 0], torch.ones(d, dtype=F64))
    torch.testing.assert_close(u[1, 0], torch.zeros(d, dtype=F64))


@pytest.mark.parametrize(("l", "k"), [(1, 3), (2, 3), (9, 4), (5, 1)])
def test_short_conv_forms_agree(l: int, k: int) -> None:
    g = torch.Generator().manual_seed(l)
    b, c = 2, 5
    x = torch.randn(b, l, c, generator=g, dtype=F64)
    w = torch.randn(c, k, generator=g, dtype=F64)
    bias = torch.randn(c, generator=g, dtype=F64)
    s0 = torch.randn(b, k - 1, c, generator=g, dtype=F64)
    y_ref, s_ref = short_conv_reference(x, w, bias, state=s0)
    y, s = short_conv(x, w, bias, state=s0)
    torch.testing.assert_close(y, y_ref, **TOL[F64])
    torch.testing.assert_close(s, s_ref, **TOL[F64])
    state = s0
    for t in range(l):
        yt, state = short_conv_step(x[:, t], w, bias, state)
        torch.testing.assert_close(yt, y_ref[:, t], **TOL[F64])
    torch.testing.assert_close(state, s_ref, **TOL[F64])


# ---------------------------------------------------------------------- RWKV-7


def _rwkv7_inputs(c: dict, g: torch.Generator, forms):
    q, k, v, s0, mask = _qkv(c, g, forms)
    kappa = F.normalize(torch.randn(q.shape, generator=g, dtype=c["dtype"]), dim=-1)
    a_gate = torch.rand(q.shape, generator=g, dtype=c["dtype"])
    gk = -torch.rand(q.shape, generator=g, dtype=c["dtype"]) * (8.0 if c["gated"] else 0.6)
    return [q, k, v, -kappa, kappa * a_gate, gk], s0, mask


@SETTINGS
@given(case())
def test_rwkv7_chunked_equals_reference(forms, c: dict) -> None:
    g = torch.Generator().manual_seed(c["seed"])
    inputs, s0, mask = _rwkv7_inputs(c, g, forms)

    def ref(*xs):
        return rwkv7_reference(*xs, state=s0, mask=mask)

    def fast(*xs):
        return rwkv7_chunked(*xs, state=s0, mask=mask, chunk_size=c["chunk"])

    forms.assert_equal(ref, fast, inputs, c["dtype"], g)


def test_rwkv7_reference_is_the_papers_update() -> None:
    """Peng et al. (2025) eq. 3-5 on ``wkv [V, K]``: ``wkv_t = wkv_{t-1} (diag(w_t) -
    kappa_t^T (a_t kappa_t)) + v_t^T k_t``, ``o_t = wkv_t r_t``, one head at a time."""
    g = torch.Generator().manual_seed(4)
    b, h, l, dk, dv = 1, 2, 9, 4, 3
    r, k = (torch.randn(b, h, l, dk, generator=g, dtype=F64) for _ in range(2))
    v = torch.randn(b, h, l, dv, generator=g, dtype=F64)
    kappa = F.normalize(torch.randn(b, h, l, dk, generator=g, dtype=F64), dim=-1)
    a_gate = torch.rand(b, h, l, dk, generator=g, dtype=F64)
    w = torch.rand(b, h, l, dk, generator=g, dtype=F64) * 0.5 + 0.5
    s0 = torch.randn(b, h, dk, dv, generator=g, dtype=F64)
    want = torch.zeros(b, h, l, dv, dtype=F64)
    for hi in range(h):
        wkv = s0[0, hi].T.clone()
        for t in range(l):
            kap, at = kappa[0, hi, t], a_gate[0, hi, t]
            trans = torch.diag(w[0, hi, t]) - torch.outer(kap, at * kap)
            wkv = wkv @ trans + torch.outer(v[0, hi, t], k[0, hi, t])
            want[0, hi, t] = wkv @ r[0, hi, t]
    o, s = rwkv7_reference(r, k, v, -kappa, kappa * a_gate, w.log(), state=s0)
    torch.testing.assert_close(o, want, **TOL[F64])
    state = s0
    for t in range(l):
        args = (x[:, :, t] for x in (r, k, v, -kappa, kappa * a_gate, w.log()))
        ot, state = rwkv7_step(*args, state)
        torch.testing.assert_close(ot, o[:, :, t], **TOL[F64])
    torch.testing.assert_close(state, s, **TOL[F64])


@pytest.mark.parametrize("per_token", [0.6, 0.7])
def test_rwkv7_one_matmul_scores_and_sub_chunks_agree(per_token: float, monkeypatch) -> None:
    """A 64-token chunk decaying 38.4 nats takes the one-matmul scores, 44.8 the
    sub-chunked ones (``FACTORED_RANGE`` = 40); both equal the reference, with gradients."""
    from attnlab.functional import rwkv7 as mod

    calls = []
    real = mod.intra_chunk_scores
    monkeypatch.setattr(mod, "intra_chunk_scores", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(7)
    b, h, l, dk, dv = 1, 2, 70, 4, 3
    q, k = (torch.randn(b, h, l, dk, generator=g, dtype=F64) for _ in range(2))
    v = torch.randn(b, h, l, dv, generator=g, dtype=F64)
    kappa = F.normalize(torch.randn(b, h, l, dk, generator=g, dtype=F64), dim=-1)
    gk = torch.full((b, h, l, dk), -per_token, dtype=F64)
    xs = [x.requires_grad_(True) for x in (q, k, v, -kappa, kappa * 0.5, gk)]
    o_ref, s_ref = rwkv7_reference(*xs)
    o, s = rwkv7_chunked(*xs, chunk_size=64)
    assert bool(calls) == (per_token * 64 > mod.FACTORED_RANGE)
    torch.testing.assert_close(o, o_ref, **TOL[F64])
    torch.testing.assert_close(s, s_ref, **TOL[F64])
    w = torch.randn(o.shape, generator=g, dtype=F64)
    grads = torch.autograd.grad((o * w).sum() + s.sum(), xs)
    want = torch.autograd.grad((o_ref * w).sum() + s_ref.sum(), xs)
    for got, ref in zip(grads, want, strict=True):
        torch.testing.assert_close(got, ref, **TOL[F64])
