"""Next-token selection: greedy, top-k and top-p filtering as defined, and bad settings."""

from __future__ import annotations

import pytest
import torch

from attnlab.errors import NonFiniteError
from attnlab.functional.sampling import (
    check_sampling,
    greedy_token,
    next_token,
    top_k_filter,
    top_p_filter,
)


def test_greedy_is_argmax() -> None:
    logits = torch.randn(4, 30)
    assert torch.equal(next_token(logits), logits.argmax(-1))


@pytest.mark.parametrize("vocab", [100, 128, 129, 1000, 32000])
def test_blocked_greedy_equals_max_with_ties_nan_and_the_tail(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    for trial in range(12):
        logits = torch.randint(-2, 3, (5, vocab), generator=g).float()  # many ties
        if trial % 4 == 1:
            logits[1:3, -1] = 9.0  # the maximum in the tail past the last whole block
        if trial % 4 == 2:
            logits[0, vocab // 2] = float("nan")
        if trial % 4 == 3:
            logits[3] = float("-inf")
        values, indices = greedy_token(logits)
        assert torch.equal(indices, logits.argmax(-1))
        torch.testing.assert_close(values, logits.max(-1).values, rtol=0, atol=0, equal_nan=True)


def test_greedy_refuses_non_finite_rows_by_name() -> None:
    logits = torch.zeros(3, 300)
    logits[1, 7] = float("nan")
    with pytest.raises(NonFiniteError, match=r"step 4.*row\(s\) \[1\]"):
        next_token(logits, step=4)


def test_top_k_keeps_exactly_the_k_largest() -> None:
    logits = torch.randn(3, 50)
    out = top_k_filter(logits, 5)
    kept = torch.isfinite(out)
    assert kept.sum(-1).tolist() == [5, 5, 5]
    top = logits.topk(5, dim=-1).indices
    assert bool(kept.gather(-1, top).all())
    torch.testing.assert_close(out[kept], logits[kept])


def test_top_p_keeps_the_smallest_nucleus() -> None:
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])
    logits = probs.log()
    # 0.5 < 0.6, 0.5 + 0.2 >= 0.6: keep the first two
    assert torch.isfinite(top_p_filter(logits, 0.6)).tolist() == [[True, True, False, False, False]]
    # mass above the third token is 0.7 < 0.8: keep three
    assert torch.isfinite(top_p_filter(logits, 0.8)).sum().item() == 3
    # the most likely token always stays
    assert torch.isfinite(top_p_filter(logits, 1e-6)).sum().item() == 1
    assert torch.isfinite(top_p_filter(logits, 1.0)).all()


def test_top_p_matches_transformers() -> None:
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = torch.randn(6, 40)
    for p in (0.3, 0.75, 0.95):
        ref = TopPLogitsWarper(p)(torch.zeros(6, 1, dtype=torch.long), logits.clone())
        assert torch.equal(torch.isfinite(top_p_filter(logits, p)), torch.isfinite(ref))


def test_sampling_is_reproducible_with_a_seeded_generator_and_respects_top_k() -> None:
    logits = torch.randn(8, 100)

    def draw(seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.stack(
            [next_token(logits, do_sample=True, top_k=3, generator=g) for _ in range(20)]
        )

    a, b = draw(1), draw(1)
    assert torch.equal(a, b)
    top3 = logits.topk(3, dim=-1).indices  # [8, 3]
    assert bool((a[..., None] == top3[None]).any(-1).all())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"do_sample": True, "temperature": 0.0, "top_k": None, "top_p": None}, "temperature"),
        ({"do_sample": True, "temperature": -1.0, "top_k": None, "top_p": None}, "temperature"),
        ({"do_sample": True, "temperature": 1.0, "top_k": None, "top_p": 0.0}, "top_p"),
        ({"do_sample": True, "temperature": 1.0, "top_k": None, "top_p": 1.5}, "top_p"),
        ({"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": None}, "top_k"),
    ],
)
def test_bad_sampling_settings_raise(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_sampling(**kwargs)


def test_temperature_zero_is_fine_without_sampling() -> None:
    check_sampling(do_sample=False, temperature=0.0, top_k=None, top_p=None)
