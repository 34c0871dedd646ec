"""Routers and auxiliary losses against transformers' functions and the papers' formulas."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.functional.routing import (
    expert_capacity,
    expert_choice,
    input_jitter,
    load_balancing_loss,
    logit_noise,
    router_z_loss,
    token_choice,
)

mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")


@settings(max_examples=40)
@given(
    layers=st.integers(1, 3),
    batch=st.integers(1, 3),
    seq=st.integers(1, 9),
    experts=st.integers(2, 8),
    data=st.data(),
)
def test_load_balancing_loss_equals_transformers(
    layers: int, batch: int, seq: int, experts: int, data: st.DataObject
) -> None:
    top_k = data.draw(st.integers(1, experts))
    g = torch.Generator().manual_seed(layers * 100 + batch * 10 + seq)
    logits = tuple(torch.randn(batch * seq, experts, generator=g) * 2 for _ in range(layers))
    ours = load_balancing_loss(logits, experts, top_k)
    theirs = mixtral.load_balancing_loss_func(logits, experts, top_k)
    torch.testing.assert_close(ours, theirs)
    # left padding: at least one real token per row
    pad = data.draw(st.lists(st.integers(0, seq - 1), min_size=batch, max_size=batch))
    mask = torch.ones(batch, seq, dtype=torch.long)
    for row, p in enumerate(pad):
        mask[row, :p] = 0
    ours = load_balancing_loss(logits, experts, top_k, mask)
    theirs = mixtral.load_balancing_loss_func(logits, experts, top_k, mask)
    torch.testing.assert_close(ours, theirs)


def test_load_balancing_loss_minimum_is_top_k_for_a_uniform_router() -> None:
    # f_e = k / E and P_e = 1 / E for every expert: E * sum_e (k / E)(1 / E) = k
    # (topk of equal probabilities picks the first k; rotate which are first per token)
    e, k = 4, 2
    logits = torch.zeros(8, e)
    logits += torch.eye(e).repeat(2, 1) * 1e-6 + torch.eye(e).roll(1, 0).repeat(2, 1) * 1e-6
    loss = load_balancing_loss(logits, e, k)
    torch.testing.assert_close(loss, torch.tensor(float(k)), atol=1e-4, rtol=0)


def test_softmax_topk_renormalised_and_not() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = torch.softmax(logits, -1)
    r = token_choice(logits, 2, normalize=False)
    torch.testing.assert_close(r.weights, probs[:, :2])
    assert r.experts.tolist() == [[0, 1]]
    r = token_choice(logits, 2, normalize=True)
    torch.testing.assert_close(r.weights, probs[:, :2] / probs[:, :2].sum())
    # softmax after top-k equals renormalised softmax-then-top-k (same ratios)
    r2 = token_choice(logits, 2, router="topk_softmax")
    torch.testing.assert_close(r2.weights, r.weights)
    sw = token_choice(logits, 1, router="switch")
    torch.testing.assert_close(sw.weights, probs[:, :1])


def test_token_choice_refuses_bad_arguments() -> None:
    logits = torch.randn(3, 4)
    with pytest.raises(ValueError, match="top_k \\(5\\)"):
        token_choice(logits, 5)
    with pytest.raises(ValueError, match="switch"):
        token_choice(logits, 2, router="switch")
    with pytest.raises(ValueError, match="router must be one of"):
        token_choice(logits, 2, router="hash")
    with pytest.raises(ValueError, match="router_logits must be floating"):
        token_choice(torch.ones(3, 4, dtype=torch.long), 2)


def test_expert_choice_picks_each_experts_best_tokens() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(10, 3, generator=g)
    r = expert_choice(logits, 4)
    scores = torch.softmax(logits, -1)
    for e in range(3):
        best = torch.argsort(scores[:, e], descending=True)[:4]
        assert r.tokens[e].tolist() == best.tolist()
        torch.testing.assert_close(r.weights[e], scores[best, e])
    with pytest.raises(ValueError, match="capacity \\(11\\)"):
        expert_choice(logits, 11)


def test_expert_capacity() -> None:
    assert expert_capacity(4096, 8, 2, 1.25) == 1280
    assert expert_capacity(3, 8, 1, 1.0) == 1
    with pytest.raises(ValueError, match="capacity_factor"):
        expert_capacity(10, 2, 1, 0.0)


def test_router_z_loss_formula() -> None:
    logits = torch.tensor([[0.0, 0.0], [1.0, 3.0]])
    z = torch.logsumexp(logits, -1) ** 2
    torch.testing.assert_close(router_z_loss(logits), z.mean())
    mask = torch.tensor([[1, 0]])
    torch.testing.assert_close(router_z_loss(logits, mask), z[0])
    torch.testing.assert_close(
        router_z_loss([logits, 2 * logits]),
        (z.mean() + (torch.logsumexp(2 * logits, -1) ** 2).mean()) / 2,
    )


def test_noise_is_seeded_and_bounded() -> None:
    x = torch.ones(100, 4)
    y = input_jitter(x, 0.1, generator=torch.Generator().manual_seed(0))
    assert (y >= 0.9).all() and (y <= 1.1).all() and not torch.equal(y, x)
    assert input_jitter(x, 0.0) is x
    a = logit_noise(x, 1.0, generator=torch.Generator().manual_seed(1))
    b = logit_noise(x, 1.0, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and (a - x).std() > 0.5
