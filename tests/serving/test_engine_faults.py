"""One bad request never kills the engine: requests are validated before they enter, and a
fault inside a step fails its request alone (blocks freed, error kept, the rest exact)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import attnlab.serving.step_sampling as step_sampling
from attnlab.serving import Engine, ParamError, SamplingParams
from attnlab.serving.server import load_engine

MARK = (1, 0.0)  # a logit_bias entry that changes nothing: marks the request to poison


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    eng, _ = load_engine(model_dir, num_blocks=64, block_size=4, max_num_batched_tokens=32)
    return eng


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.9, seed=5, n=2, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.7, top_k=20, seed=6, ignore_eos=True),
    ]


PROMPTS = ["def wrap(text", "class Formatter:", "import string"]


def _tokens(results: list[list[Any]]) -> list[list[list[int]]]:
    return [[c.token_ids for c in choices] for choices in results]


@pytest.mark.parametrize("fault", ["raise", "nan"])
def test_a_fault_in_one_requests_sampling_fails_it_alone(
    engine: Engine, fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = _tokens(engine.generate(PROMPTS, _params()))
    real = step_sampling.sample
    calls = {"poisoned": 0}

    def poisoned(logits: torch.Tensor, rows: list[Any], **kw: Any) -> Any:
        hit = [i for i, r in enumerate(rows) if MARK[0] in r.settings.logit_bias]
        if hit:
            calls["poisoned"] += 1
            if fault == "raise":
                raise RuntimeError("injected fault")
            logits = logits.clone()
            logits[hit, 3] = float("nan")
        return real(logits, rows, **kw)

    monkeypatch.setattr(step_sampling, "sample", poisoned)
    bad = SamplingParams(max_tokens=10, temperature=0.8, seed=1, logit_bias=[MARK])
    results = engine.generate(
        [PROMPTS[0], "hello", *PROMPTS[1:]], [_params()[0], bad, *_params()[1:]]
    )
    assert calls["poisoned"] >= 1
    failed = results[1]
    assert [c.finish_reason for c in failed] == ["error"]
    assert failed[0].error and ("injected" in failed[0].error or "NaN" in failed[0].error)
    assert _tokens([results[0], *results[2:]]) == reference  # the others, exactly
    assert not engine.requests and not engine.has_work()
    assert engine.pool.num_used_blocks == 0
    monkeypatch.setattr(step_sampling, "sample", real)
    assert _tokens(engine.generate(PROMPTS, _params())) == reference  # and it goes on


def test_a_fault_in_the_forward_fails_its_requests_and_the_engine_goes_on(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = _tokens(engine.generate(PROMPTS[:1], _params()[:1]))
    model = engine.model
    real_forward = model.forward_flat  # the step's one forward

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected forward fault")

    monkeypatch.setattr(model, "forward_flat", broken)
    out = engine.generate(["x y z"], SamplingParams(max_tokens=4))
    assert out[0][0].finish_reason == "error" and "injected forward" in str(out[0][0].error)
    assert engine.pool.num_used_blocks == 0 and not engine.has_work()
    monkeypatch.setattr(model, "forward_flat", real_forward)
    assert _tokens(engine.generate(PROMPTS[:1], _params()[:1])) == reference


def test_requests_are_validated_before_they_enter(engine: Engine) -> None:
    with pytest.raises(ParamError) as e:
        SamplingParams(seed=2**64)
    assert e.value.param == "seed" and "9223372036854775807" in str(e.value)
    with pytest.raises(ParamError) as e:
        SamplingParams(seed=-1)
    assert e.value.param == "seed"
    with pytest.raises(ParamError) as e:
        engine.generate(["ok", "also"], [SamplingParams(), SamplingParams(logit_bias={10**6: 1})])
    assert e.value.param == "logit_bias" and not engine.has_work()  # nothing was queued
    # the largest seed with n=2: choice 1 is seeded 2**63, within torch's range
    out = engine.generate(["abc"], SamplingParams(max_tokens=3, seed=2**63 - 1, n=2))
    assert [c.finish_reason for c in out[0]] != ["error", "error"]
    # a temperature below 1e-5 is greedy decoding, never a non-finite distribution
    tiny = engine.generate(["abc"], SamplingParams(max_tokens=6, temperature=1e-300))
    greedy = engine.generate(["abc"], SamplingParams(max_tokens=6, temperature=0))
    assert tiny[0][0].token_ids == greedy[0][0].token_ids
    assert SamplingParams(temperature=1e-300).greedy
