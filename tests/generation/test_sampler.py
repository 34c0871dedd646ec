"""The batched sampler against independent implementations: transformers' logits processors
(one row at a time) and float64 loops."""

from __future__ import annotations

import pytest
import torch

from attnlab.functional.sampling import apply_penalties, min_p_filter, top_k_filter, unpack_bitmask
from attnlab.generation.sampler import RowSampling, SamplingSettings, sample

lp = pytest.importorskip("transformers.generation.logits_process")

V = 50


def _logits(b: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, V, generator=torch.Generator().manual_seed(seed)) * 3


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_repetition_penalty_equals_transformers_row_by_row() -> None:
    logits = _logits(4)
    prompts = [_ids(6, 1), _ids(3, 2), _ids(9, 3), _ids(1, 4)]
    outputs = [_ids(4, 5), [], _ids(7, 6), _ids(2, 7)]
    penalties = [1.3, 0.7, 2.0, 1.0]
    rows = [
        RowSampling(SamplingSettings(temperature=0, repetition_penalty=p), pr, out)
        for p, pr, out in zip(penalties, prompts, outputs, strict=True)
    ]
    got = sample(logits, rows).tokens
    for i, p in enumerate(penalties):
        ids = torch.tensor([prompts[i] + outputs[i]])
        ref = lp.RepetitionPenaltyLogitsProcessor(p)(ids, logits[i : i + 1].clone())
        assert got[i] == int(ref.argmax())
        seen = torch.zeros(1, V, dtype=torch.bool)
        seen[0, ids[0]] = True
        mine = apply_penalties(
            logits[i : i + 1],
            output_counts=torch.zeros(1, V),
            seen=seen,
            repetition=torch.tensor([p]),
        )
        torch.testing.assert_close(mine, ref)


def test_presence_and_frequency_penalties_equal_a_float64_loop() -> None:
    logits = _logits(3, 1)
    outputs = [_ids(12, 8), _ids(5, 9), []]
    settings = [(0.5, 0.3), (-1.0, 2.0), (2.0, -2.0)]
    x = logits.double().clone()
    for i, (pres, freq) in enumerate(settings):
        for tok in set(outputs[i]):
            x[i, tok] -= pres + freq * outputs[i].count(tok)
    counts = torch.zeros(3, V)
    for i, out in enumerate(outputs):
        for tok in out:
            counts[i, tok] += 1
    mine = apply_penalties(
        logits,
        output_counts=counts,
        presence=torch.tensor([s[0] for s in settings]),
        frequency=torch.tensor([s[1] for s in settings]),
    )
    torch.testing.assert_close(mine.double(), x, atol=1e-5, rtol=0)
    rows = [
        RowSampling(SamplingSettings(temperature=0, presence_penalty=p, frequency_penalty=f), (), o)
        for (p, f), o in zip(settings, outputs, strict=True)
    ]
    assert sample(logits, rows).tokens == x.argmax(-1).tolist()


def test_min_p_equals_transformers_and_top_k_per_row() -> None:
    logits = _logits(5, 2)
    values = [0.0, 0.05, 0.2, 0.5, 1.0]
    mine = min_p_filter(logits, torch.tensor(values))
    for i, m in enumerate(values):
        if m == 0.0:
            assert torch.isfinite(mine[i]).all()
            continue
        ref = lp.MinPLogitsWarper(m)(torch.zeros(1, 1, dtype=torch.long), logits[i : i + 1].clone())
        assert torch.equal(torch.isfinite(mine[i : i + 1]), torch.isfinite(ref))
    ks = [1, 3, 0, 10, 60]  # 0 and >= V: unfiltered
    mine = top_k_filter(logits, torch.tensor(ks))
    for i, k in enumerate(ks):
        if k == 0 or k >= V:
            assert torch.isfinite(mine[i]).all()
            continue
        ref = lp.TopKLogitsWarper(k)(torch.zeros(1, 1, dtype=torch.long), logits[i : i + 1].clone())
        assert torch.equal(torch.isfinite(mine[i : i + 1]), torch.isfinite(ref))


def test_logit_bias_and_banned_tokens_equal_transformers() -> None:
    logits = _logits(3, 3)
    biases = [{7: 100.0}, {int(logits[1].argmax()): -100.0, 3: 2.5}, {}]
    banned = [[], [], [int(logits[2].argmax()), 4]]
    rows = [
        RowSampling(SamplingSettings(temperature=0, logit_bias=b), banned=ban)
        for b, ban in zip(biases, banned, strict=True)
    ]
    got = sample(logits, rows).tokens
    for i in range(2):
        proc = lp.SequenceBiasLogitsProcessor([[[t], v] for t, v in biases[i].items()])
        ref = proc(torch.zeros(1, 1, dtype=torch.long), logits[i : i + 1].clone())
        assert got[i] == int(ref.argmax())
    # banned before min_tokens: transformers' MinNewTokensLengthLogitsProcessor with those ids
    proc = lp.MinNewTokensLengthLogitsProcessor(1, 5, eos_token_id=banned[2])
    ref = proc(torch.zeros(1, 2, dtype=torch.long), logits[2:3].clone())
    assert got[2] == int(ref.argmax()) and got[2] not in banned[2]


def test_the_inverse_cdf_draws_from_the_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -9.0]])
    probs = torch.softmax(logits.double() / 0.7, -1)[0]
    g = torch.Generator().manual_seed(0)
    n = 20_000
    rows = [RowSampling(SamplingSettings(temperature=0.7))] * n
    tokens = sample(logits.expand(n, -1), rows, generator=g).tokens
    freq = torch.bincount(torch.tensor(tokens), minlength=5).double() / n
    # four standard errors of a binomial frequency
    assert torch.all((freq - probs).abs() <= 4 * (probs * (1 - probs) / n).sqrt() + 1e-9)


def test_a_token_of_weight_zero_is_never_drawn_even_at_the_ends_of_u(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``u = 0`` and the largest float64 below 1 choose the first and the last token of
    nonzero weight, never a masked one (leading and trailing ones included)."""
    from attnlab.generation import sampler as sampler_mod

    logits = torch.tensor([[-5.0, 1.0, 2.0, 0.5, 3.0, -1.0, 0.0]])
    rows = [RowSampling(SamplingSettings(temperature=1.0), banned=[0, 5, 6])] * 2
    ends = torch.tensor([0.0, 1.0 - 2.0**-53], dtype=torch.float64)
    monkeypatch.setattr(sampler_mod, "draw_uniforms", lambda rows, fallback: ends)
    assert sample(logits.expand(2, -1), rows).tokens == [1, 4]


def test_a_seeded_row_samples_the_same_whatever_its_neighbours() -> None:
    logits = _logits(4, 4)

    def draw(order: list[int]) -> list[int]:
        rows = [
            RowSampling(
                SamplingSettings(temperature=1.0, top_p=0.9),
                generator=torch.Generator().manual_seed(100 + i),
            )
            for i in order
        ]
        return sample(logits[order], rows, generator=torch.Generator().manual_seed(9)).tokens

    a = draw([0, 1, 2, 3])
    b = draw([3, 2, 1, 0])
    assert a == b[::-1]


def test_a_row_that_cannot_give_a_token_fails_alone() -> None:
    logits = _logits(3, 5)
    logits[1, 4] = float("nan")
    rows = [
        RowSampling(SamplingSettings(temperature=0)),
        RowSampling(SamplingSettings(temperature=0.5)),
        RowSampling(SamplingSettings(temperature=0.5, logprobs=2), banned=list(range(V))),
    ]
    out = sample(logits, rows)
    assert out.tokens[0] == int(logits[0].argmax()) and out.tokens[1:] == [-1, -1]
    assert set(out.failed) == {1, 2}
    assert "NaN" in out.failed[1] and "masked" in out.failed[2]


def test_logprobs_are_the_models_and_the_bitmask_masks() -> None:
    logits = _logits(2, 6)
    allowed = [5, 33, 49]
    bitmask = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
    for t in allowed:
        bitmask[0, t // 32] |= 1 << (t % 32)
    assert unpack_bitmask(bitmask, V)[0].nonzero().flatten().tolist() == allowed
    rows = [
        RowSampling(SamplingSettings(temperature=0, logprobs=3), bitmask_row=0),
        RowSampling(SamplingSettings(temperature=0, logprobs=0)),
    ]
    out = sample(logits, rows, bitmask=bitmask)
    assert out.tokens[0] == max(allowed, key=lambda t: float(logits[0, t]))
    ref = torch.log_softmax(logits.double(), -1)
    chosen, top = out.logprobs[0]  # type: ignore[misc]
    assert chosen == pytest.approx(float(ref[0, out.tokens[0]]), abs=1e-5)
    assert [t for t, _ in top] == ref[0].topk(3).indices.tolist()
    assert out.logprobs[1] is not None and out.logprobs[1][1] == []


def test_the_callers_logits_are_never_written() -> None:
    """Greedy rows read the logits as they are (no copy); bans, biases and grammar masks
    write into a copy of them."""
    logits = _logits(3, 5)
    before = logits.clone()
    plain = [RowSampling(SamplingSettings(temperature=0)) for _ in range(3)]
    assert sample(logits, plain).tokens == logits.argmax(-1).tolist()
    ties = torch.zeros(3, V)
    ties[:, [7, 30]] = 1.0  # a greedy tie goes to the first maximum, as argmax
    assert sample(ties, plain).tokens == [7, 7, 7]
    top = int(logits[1].argmax())
    rows = [
        RowSampling(SamplingSettings(temperature=0, logit_bias={3: 50.0})),
        RowSampling(SamplingSettings(temperature=0), banned=[top]),
        RowSampling(SamplingSettings(temperature=0.7), generator=torch.Generator().manual_seed(0)),
    ]
    got = sample(logits, rows).tokens
    assert got[0] == 3 and got[1] != top
    assert torch.equal(logits, before)


def test_a_seeded_row_draws_one_float64_uniform_per_position() -> None:
    """The seeded stream rule (docs/serving.md): each sampled position of a seeded row
    takes one ``torch.rand(1, dtype=float64)`` from its generator, which
    :func:`skip_draws` replays (the engine's speculative rewind relies on it)."""
    from attnlab.generation.sampler import skip_draws

    logits = _logits(1, 7)
    g = torch.Generator().manual_seed(5)
    row = RowSampling(SamplingSettings(temperature=1.0), generator=g)
    for _ in range(3):
        sample(logits, [row])
    replay = torch.Generator().manual_seed(5)
    skip_draws(replay, 3)
    assert torch.equal(g.get_state(), replay.get_state())
    # the token is the inverse CDF at that uniform
    u = float(torch.rand(1, dtype=torch.float64, generator=torch.Generator().manual_seed(5)))
    first = sample(logits, [RowSampling(row.settings, generator=torch.Generator().manual_seed(5))])
    cdf = torch.softmax(logits[0].double(), -1).cumsum(-1)
    assert first.tokens[0] == int((cdf <= u).sum())


def test_the_two_level_inverse_cdf_equals_a_float64_running_sum() -> None:
    """Blocks of 256, a padded last block, a block of zeros and scattered zeros: the token
    is the float64 reference's at every u (away from an interval's edge by rounding)."""
    from attnlab.generation.sampler import inverse_cdf

    gen = torch.Generator().manual_seed(11)
    vocab = 700  # three blocks, the last one padded
    w = torch.rand(4, vocab, generator=gen) ** 4
    w[:, 256:512] = 0.0  # a whole block of zero weight
    w[torch.rand(4, vocab, generator=gen) < 0.3] = 0.0
    w[3, :] = 0.0
    w[3, 699] = 2.0  # one token of weight: always it
    for _ in range(50):
        u = torch.rand(4, dtype=torch.float64, generator=gen)
        got = inverse_cdf(w, u)
        c = w.double().cumsum(-1)
        x = u[:, None] * c[:, -1:]
        ref = torch.searchsorted(c, x, right=True)[:, 0]
        edge = (c - x).abs().min(-1).values < 1e-9 * c[:, -1]
        assert torch.all((got == ref) | edge), (got, ref)
        assert torch.all(w[torch.arange(4), got] > 0)
    assert inverse_cdf(w, torch.zeros(4, dtype=torch.float64))[3] == 699
