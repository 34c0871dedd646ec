"""Every dispatch equals the per-token reference loop, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.functional.expert_dispatch import (
    grouped_mm_available,
    moe_capacity,
    moe_dropless,
    moe_expert_choice,
    moe_expert_choice_reference,
    moe_reference,
)
from attnlab.functional.routing import expert_choice, token_choice

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float64: dict(atol=1e-10, rtol=1e-10)}


def _case(
    n: int, d: int, f: int, e: int, gated: bool, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=dtype)
    w_in = torch.randn(e, (2 if gated else 1) * f, d, generator=g, dtype=dtype) / d**0.5
    w_out = torch.randn(e, d, f, generator=g, dtype=dtype) / f**0.5
    gate = torch.randn(n, e, generator=g, dtype=dtype)
    return x, w_in, w_out, gate


def _grads(out: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    seed = torch.Generator().manual_seed(7)
    cot = torch.randn(out.shape, generator=seed, dtype=out.dtype)
    return torch.autograd.grad(out, inputs, cot, retain_graph=True)


@settings(max_examples=30)
@given(
    n=st.integers(1, 24),
    e=st.integers(1, 6),
    data=st.data(),
    gated=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    router=st.sampled_from(["softmax_topk", "topk_softmax"]),
    normalize=st.booleans(),
    grouped=st.sampled_from([None, False]),
)
def test_dispatches_equal_the_reference_loop(
    n: int,
    e: int,
    data: st.DataObject,
    gated: bool,
    dtype: torch.dtype,
    router: str,
    normalize: bool,
    grouped: bool | None,
) -> None:
    k = data.draw(st.integers(1, e))
    if k == 1 and data.draw(st.booleans()):
        router = "switch"  # Switch: top-1 probability, not renormalised
    d, f = data.draw(st.sampled_from([(8, 12), (4, 4), (6, 5)]))
    x, w_in, w_out, gate = _case(n, d, f, e, gated, dtype, seed=n * 31 + e)
    params = [t.requires_grad_() for t in (x, w_in, w_out, gate)]
    routing = token_choice(gate, k, router=router, normalize=normalize)
    kw = dict(activation=F.silu if gated else F.gelu, gated=gated)
    ref = moe_reference(x, routing, w_in, w_out, **kw)
    ref_g = _grads(ref, *params)
    outs = {
        "dropless": moe_dropless(x, routing, w_in, w_out, use_grouped_mm=grouped, **kw),
        # a capacity that holds every assignment: nothing dropped
        "capacity": moe_capacity(x, routing, w_in, w_out, capacity=n * k, **kw).output,
    }
    for name, out in outs.items():
        torch.testing.assert_close(out, ref, **TOL[dtype], msg=name)
        for a, b in zip(_grads(out, *params), ref_g):
            torch.testing.assert_close(a, b, **TOL[dtype], msg=f"{name} grad")


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
def test_dropless_grouped_mm_path_is_taken_and_equals_padded_bmm() -> None:
    x, w_in, w_out, gate = _case(40, 16, 24, 5, True, torch.float32, seed=3)
    assert grouped_mm_available(x, w_in, w_out)
    assert not grouped_mm_available(x.double(), w_in.double(), w_out.double())
    # a group can be empty: route nobody to expert 4
    gate[:, 4] = -1e9
    routing = token_choice(gate, 2)
    kw = dict(activation=F.silu, gated=True)
    params = [t.requires_grad_() for t in (x, w_in, w_out)]
    a = moe_dropless(x, routing, w_in, w_out, use_grouped_mm=True, **kw)
    b = moe_dropless(x, routing, w_in, w_out, use_grouped_mm=False, **kw)
    torch.testing.assert_close(a, b, **TOL[torch.float32])
    for ga, gb in zip(_grads(a, *params), _grads(b, *params)):
        torch.testing.assert_close(ga, gb, **TOL[torch.float32])


@settings(max_examples=25)
@given(n=st.integers(2, 30), e=st.integers(2, 5), k=st.integers(1, 2), factor=st.floats(0.2, 1.5))
def test_capacity_drops_the_overflow_in_priority_order(
    n: int, e: int, k: int, factor: float
) -> None:
    k = min(k, e)
    x, w_in, w_out, gate = _case(n, 4, 4, e, False, torch.float64, seed=n + e)
    routing = token_choice(gate, k, normalize=False)
    cap = max(1, int(factor * k * n / e))
    res = moe_capacity(x, routing, w_in, w_out, capacity=cap, activation=F.relu, gated=False)
    # expected kept set: walk first choices, then second choices, in token order
    used = [0] * e
    kept = torch.zeros(n, k, dtype=torch.bool)
    for j in range(k):
        for t in range(n):
            ex = int(routing.experts[t, j])
            if used[ex] < cap:
                used[ex] += 1
                kept[t, j] = True
    assert torch.equal(res.kept, kept)
    torch.testing.assert_close(res.dropped, 1 - kept.float().mean())
    # the kept assignments' result equals the reference with dropped weights zeroed
    masked = routing._replace(weights=routing.weights * kept)
    ref = moe_reference(x, masked, w_in, w_out, activation=F.relu, gated=False)
    torch.testing.assert_close(res.output, ref, **TOL[torch.float64])


@settings(max_examples=15)
@given(n=st.integers(2, 16), e=st.integers(1, 4), data=st.data())
def test_expert_choice_dispatch_equals_its_loop(n: int, e: int, data: st.DataObject) -> None:
    cap = data.draw(st.integers(1, n))
    x, w_in, w_out, gate = _case(n, 4, 8, e, True, torch.float64, seed=n * e)
    params = [t.requires_grad_() for t in (x, w_in, w_out, gate)]
    routing = expert_choice(gate, cap)
    kw = dict(activation=F.silu, gated=True)
    a = moe_expert_choice(x, routing, w_in, w_out, **kw)
    b = moe_expert_choice_reference(x, routing, w_in, w_out, **kw)
    torch.testing.assert_close(a, b, **TOL[torch.float64])
    for ga, gb in zip(_grads(a, *params), _grads(b, *params)):
        torch.testing.assert_close(ga, gb, **TOL[torch.float64])


def test_reference_loop_is_the_formula() -> None:
    x, w_in, w_out, gate = _case(3, 4, 4, 2, True, torch.float64, seed=1)
    routing = token_choice(gate, 2)
    out = moe_reference(x, routing, w_in, w_out, activation=F.silu, gated=True)
    for t in range(3):
        expect = torch.zeros(4, dtype=torch.float64)
        for j in range(2):
            ex = int(routing.experts[t, j])
            gate_h, up = (w_in[ex] @ x[t]).chunk(2)
            expect += routing.weights[t, j].double() * (w_out[ex] @ (F.silu(gate_h) * up))
        torch.testing.assert_close(out[t], expect)
