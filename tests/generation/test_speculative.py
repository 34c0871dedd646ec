"""Speculative decoding: greedy output identical to plain decoding, sampling that keeps
the target's distribution (the rejection rule, tested statistically)."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from attnlab.generation.sampler import speculative_verify
from attnlab.generation.speculative import (
    NgramIndex,
    SpeculativeStats,
    prompt_lookup,
    speculative_stream,
)
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig


def _model(seed: int, layers: int = 2) -> DecoderLM:
    torch.manual_seed(seed)
    cfg = DecoderConfig(
        vocab_size=48,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
    )
    return DecoderLM(cfg).eval()


def test_prompt_lookup_continues_the_latest_match() -> None:
    assert prompt_lookup([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], num_draft=2) == [7, 5]
    assert prompt_lookup([4, 5, 6], num_draft=3) == []
    assert prompt_lookup([1, 2, 1], max_ngram=3, num_draft=4) == [2, 1]


def test_the_ngram_index_generate_drafts_with_equals_the_scan() -> None:
    """generate's drafter (built as the tokens grow) drafts what the whole-context scan
    drafts, on sequences grown one or several tokens at a time, as verification grows them."""
    import random

    rng = random.Random(1)
    for _ in range(20):
        tokens: list[int] = []
        index = NgramIndex(max_ngram=3)
        for _ in range(40):
            tokens += [rng.randrange(5) for _ in range(rng.randrange(1, 4))]
            k = rng.randrange(1, 6)
            assert index.draft(tokens, k) == prompt_lookup(tokens, max_ngram=3, num_draft=k)


@pytest.mark.parametrize("draft", ["prompt_lookup", "model"])
def test_greedy_output_is_plain_greedy(draft: str) -> None:
    model = _model(0)
    drafter = "prompt_lookup" if draft == "prompt_lookup" else _model(1, layers=1)
    torch.manual_seed(3)
    span = torch.randint(0, 48, (1, 10))
    prompt = torch.cat([span, torch.randint(0, 48, (1, 5)), span[:, :4]], dim=1)
    plain = model.generate(prompt, 30)
    st = SpeculativeStats()
    with torch.no_grad():
        new = list(speculative_stream(model, prompt, 30, draft=drafter, num_draft=4, stats=st))
    assert torch.equal(plain[0, prompt.shape[1] :], torch.tensor(new))
    assert model.generate(prompt, 30, speculative=drafter, num_draft=4).equal(plain)
    assert st.forwards <= 30 and st.accepted <= st.drafted


def test_eos_and_length_are_honoured() -> None:
    model = _model(0)
    prompt = torch.tensor([[1, 2, 3, 1, 2]])
    plain = model.generate(prompt, 12)[0, 5:].tolist()
    eos = plain[3]
    out = model.generate(prompt, 12, speculative="prompt_lookup", eos_token_id=eos)
    assert out[0, 5:].tolist() == plain[: plain.index(eos) + 1]
    assert model.generate(prompt, 1, speculative="prompt_lookup").shape == (1, 6)


def _first_token_counts(p: torch.Tensor, q: torch.Tensor | None, trials: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(p.shape[1])
    for _ in range(trials):
        if q is None:
            d = torch.tensor([2, 0])  # a deterministic draft
        else:
            d = torch.stack([torch.multinomial(q[i], 1, generator=g)[0] for i in range(2)])
        a, nxt = speculative_verify(p, d, q, generator=g)
        counts[int(d[0]) if a >= 1 else nxt] += 1
    return counts


@pytest.mark.parametrize("deterministic", [True, False])
def test_rejection_rule_keeps_the_target_distribution(deterministic: bool) -> None:
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(3, 6) * 1.5, dim=-1)
    q = None if deterministic else torch.softmax(torch.randn(2, 6) * 1.5, dim=-1)
    trials = 6000
    counts = _first_token_counts(p, q, trials)
    expected = p[0].double() / p[0].double().sum() * trials
    assert stats.chisquare(counts.double().numpy(), expected.numpy()).pvalue > 1e-3


def test_sampling_through_generate_runs_and_is_seeded() -> None:
    model = _model(0)
    prompt = torch.tensor([[5, 6, 7, 5, 6]])
    a = model.generate(prompt, 10, do_sample=True, speculative="prompt_lookup",
                       generator=torch.Generator().manual_seed(1))  # fmt: skip
    b = model.generate(prompt, 10, do_sample=True, speculative="prompt_lookup",
                       generator=torch.Generator().manual_seed(1))  # fmt: skip
    assert a.shape == (1, 15) and torch.equal(a, b)


def test_refusals_name_the_problem() -> None:
    model = _model(0)
    with pytest.raises(ValueError, match=r"input_ids must be \[1, P\]"):
        model.generate(torch.zeros(2, 3, dtype=torch.long), 4, speculative="prompt_lookup")
    with pytest.raises(ValueError, match="vocabulary"):
        small = DecoderLM(DecoderConfig(vocab_size=40, hidden_size=32, num_hidden_layers=1,
                                        num_attention_heads=4, intermediate_size=64))  # fmt: skip
        model.generate(torch.zeros(1, 3, dtype=torch.long), 4, speculative=small)
    with pytest.raises(ValueError, match="draft must be"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), 4, speculative="ngram")
    with pytest.raises(ValueError, match="compile"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), 4, speculative="prompt_lookup",
                       compile=True)  # fmt: skip
    with pytest.raises(ValueError, match="target_probs"):
        speculative_verify(torch.ones(2, 4) / 4, torch.tensor([1, 2]))
