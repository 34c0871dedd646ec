"""Distillation losses against torch's own KL and a float64 recomputation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from attnlab.functional.distill import (
    attention_kl,
    hidden_state_loss,
    kl_div_logits,
    similarity_relation_loss,
    value_relation_kl,
)


@given(
    b=st.integers(1, 3),
    n=st.integers(1, 5),
    v=st.integers(2, 9),
    t=st.sampled_from([0.5, 1.0, 2.0, 4.0]),
)
def test_forward_and_reverse_kl_equal_torch(b: int, n: int, v: int, t: float) -> None:
    s, te = torch.randn(b, n, v, dtype=torch.float64), torch.randn(b, n, v, dtype=torch.float64)
    ls, lt = F.log_softmax(s / t, -1), F.log_softmax(te / t, -1)
    fwd = F.kl_div(ls, lt, log_target=True, reduction="sum") / (b * n) * t * t
    rev = F.kl_div(lt, ls, log_target=True, reduction="sum") / (b * n) * t * t
    torch.testing.assert_close(kl_div_logits(s, te, temperature=t).double(), fwd)
    torch.testing.assert_close(
        kl_div_logits(s, te, temperature=t, direction="reverse").double(), rev
    )


def test_kl_is_zero_on_equal_logits_and_masks_skip_positions() -> None:
    x = torch.randn(2, 4, 7)
    assert kl_div_logits(x, x).abs() < 1e-6
    s, t = torch.randn(2, 4, 7), torch.randn(2, 4, 7)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    full = kl_div_logits(s[:, :1], t[:, :1])
    part = kl_div_logits(s, t, mask=mask)
    want = (kl_div_logits(s[0, :2], t[0, :2]) * 2 + kl_div_logits(s[1, :1], t[1, :1])) / 3
    torch.testing.assert_close(part, want)
    assert full.isfinite()


def test_gradients_flow_to_the_student_only() -> None:
    s = torch.randn(3, 5, requires_grad=True)
    t = torch.randn(3, 5, requires_grad=True)
    kl_div_logits(s, t.detach(), temperature=2.0).backward()
    assert s.grad is not None and s.grad.abs().sum() > 0 and t.grad is None


def test_hidden_state_loss_with_projection() -> None:
    s, t = torch.randn(2, 3, 4), torch.randn(2, 3, 6)
    proj = torch.nn.Linear(4, 6)
    want = F.mse_loss(proj(s), t)
    torch.testing.assert_close(hidden_state_loss(s, t, projection=proj), want)
    with pytest.raises(ValueError, match="same shape"):
        hidden_state_loss(s, t)


def _kl64(tp: torch.Tensor, sp: torch.Tensor) -> torch.Tensor:
    tp, sp = tp.double(), sp.double()
    return (tp * (tp.log() - sp.log())).sum(-1)


def test_attention_kl_equals_float64_recomputation_with_padding() -> None:
    b, h, n = 2, 3, 5
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    neg = torch.where(mask.bool(), 0.0, float("-inf"))[:, None, None, :]
    a_s = (torch.randn(b, h, n, n) + neg).softmax(-1)
    a_t = (torch.randn(b, h, n, n) + neg).softmax(-1)
    got = attention_kl(a_s, a_t, mask=mask)
    rows = []
    for i in range(b):
        k = int(mask[i].sum())
        rows.append(_kl64(a_t[i, :, :k, :k], a_s[i, :, :k, :k]).mean(0))  # [k]
    want = torch.cat(rows).mean()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_value_relation_kl_float64_and_head_dims_may_differ() -> None:
    vs, vt = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 16)
    got = value_relation_kl(vs, vt)
    rs = (vs.double() @ vs.double().transpose(-1, -2) / 8**0.5).softmax(-1)
    rt = (vt.double() @ vt.double().transpose(-1, -2) / 16**0.5).softmax(-1)
    torch.testing.assert_close(got.double(), _kl64(rt, rs).mean(), rtol=1e-5, atol=1e-6)
    assert value_relation_kl(vt, vt).abs() < 1e-6


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: kl_div_logits(torch.zeros(2, 3), torch.zeros(2, 4)), "same shape"),
        (lambda: kl_div_logits(torch.zeros(2, 3), torch.zeros(2, 3), temperature=0), "temperature"),
        (
            lambda: kl_div_logits(torch.zeros(2, 3), torch.zeros(2, 3), temperature=float("nan")),
            "temperature",
        ),
        (
            lambda: kl_div_logits(torch.zeros(2, 3), torch.zeros(2, 3), direction="both"),
            "direction",
        ),
        (
            lambda: kl_div_logits(torch.zeros(2, 3), torch.zeros(2, 3), mask=torch.tensor([2, 1])),
            "0/1",
        ),
        (
            lambda: kl_div_logits(torch.zeros(2, 3), torch.zeros(2, 3), mask=torch.tensor([0, 0])),
            "no token",
        ),
        (lambda: attention_kl(torch.zeros(2, 3), torch.zeros(2, 3)), r"\[B, H, L, S\]"),
    ],
)
def test_bad_inputs(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_similarity_relation_loss_equals_a_float64_loop() -> None:
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(5, 8, generator=g), torch.randn(5, 12, generator=g)  # widths differ
    want, count = 0.0, 0
    for i in range(5):
        for j in range(5):
            if i != j:
                cs = F.cosine_similarity(s[i].double(), s[j].double(), dim=0)
                ct = F.cosine_similarity(t[i].double(), t[j].double(), dim=0)
                want += float((cs - ct) ** 2)
                count += 1
    assert float(similarity_relation_loss(s, t)) == pytest.approx(want / count, rel=1e-5)
    assert float(similarity_relation_loss(s, 3 * s)) == pytest.approx(0.0, abs=1e-6)


def test_similarity_relation_loss_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r"\[B, D\] with the same B"):
        similarity_relation_loss(torch.randn(4, 8), torch.randn(5, 8))
    with pytest.raises(ValueError, match="at least 2"):
        similarity_relation_loss(torch.randn(1, 8), torch.randn(1, 8))
    with pytest.raises(TypeError, match="tensors"):
        similarity_relation_loss([[1.0]], torch.randn(1, 8))  # type: ignore[arg-type]
