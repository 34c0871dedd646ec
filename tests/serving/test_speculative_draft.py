"""Speculative decoding with a draft model in the serving engine.

Greedy output with a draft model must equal offline ``generate`` token for token on
request mixes that hit the prefix cache, fork ``n = 2`` choices, preempt and chunk their
prompts; a draft that is the model itself must have every draft kept; the rejection rule
for sampled rows must leave each output token distributed as the model's own sampling
distribution (a statistical test on a small vocabulary, against a distribution computed
here by hand); bad settings are refused by name.
"""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.recurrent import MambaLM
from attnlab.models.recurrent_config import MambaConfig
from attnlab.serving import Engine, SamplingParams
from attnlab.serving.draft_model import verify_sampled

V = 384
ATTN = dict(
    vocab_size=V,
    hidden_size=32,
    num_hidden_layers=3,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=160,
)


def _target() -> DecoderLM:
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.llama(**ATTN)).eval()
    with torch.no_grad():  # a peaked head: the first layer already decides many argmaxes
        model.lm_head.weight.mul_(4.0)
    return model


def _first_layers(model: DecoderLM, layers: int) -> DecoderLM:
    """A smaller draft: the model's first ``layers`` layers, its norm and its head."""
    config = dataclasses.replace(model.config, num_hidden_layers=layers)
    draft = DecoderLM(config).eval()
    draft.load_state_dict(model.state_dict(), strict=False)
    return draft


@pytest.mark.parametrize("layers", [1, 3])
def test_greedy_with_a_draft_model_equals_offline_generate(
    layers: int, tokenizer: Any, prefix_prompts: Any, greedy_params: Any, small_engine: Any
) -> None:
    model = _target()
    draft = _first_layers(model, layers)  # 3 layers: the model itself, every draft kept
    prompts = prefix_prompts(random.Random(layers), V, shared=9, count=6, lengths=(3, 9))
    params = greedy_params(random.Random(layers), len(prompts), max_tokens=(20, 41))
    engine = small_engine(
        model, tokenizer, speculative="draft", draft_model=draft, num_speculative_tokens=3
    )
    results = engine.generate(prompts, params)
    for prompt, p, choices in zip(prompts, params, results, strict=True):
        ref = model.generate(torch.tensor([prompt]), p.max_tokens, compile=False)
        assert [c.token_ids for c in choices] == [ref[0, len(prompt) :].tolist()] * p.n
    m = engine.metrics
    assert m.spec_verifications > 0 and m.spec_accepted_tokens > 0
    if layers == 3:
        assert m.spec_accepted_tokens == m.spec_draft_tokens
    else:
        assert m.spec_accepted_tokens < m.spec_draft_tokens
    assert m.preemptions > 0 and engine.pool.allocator.hits > 0
    assert engine.pool.num_used_blocks == 0 and not engine.requests
    assert not engine.draft.computed  # type: ignore[union-attr]
    assert m.generation_tokens == sum(p.max_tokens * p.n for p in params)


def test_sampled_requests_with_a_draft_model_run_and_repeat_with_a_seed(
    tokenizer: Any, prefix_prompts: Any, small_engine: Any
) -> None:
    model = _target()
    draft = _first_layers(model, 1)
    prompts = prefix_prompts(random.Random(3), V, shared=9, count=4, lengths=(3, 9))
    params = [
        SamplingParams(max_tokens=25, temperature=0.8, seed=1, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=25, temperature=0.5, top_k=8, seed=2, frequency_penalty=0.4),
        SamplingParams(max_tokens=25, temperature=0.9, top_p=0.9, seed=3, min_tokens=20),
        SamplingParams(max_tokens=25, temperature=0.0),
    ]
    runs = []
    for _ in range(2):
        engine = small_engine(
            model, tokenizer, speculative="draft", draft_model=draft, num_speculative_tokens=3
        )
        runs.append(engine.generate(prompts, params))
        m = engine.metrics
        assert 0 < m.spec_accepted_tokens < m.spec_draft_tokens
        assert engine.pool.num_used_blocks == 0
    assert [[c.token_ids for c in r] for r in runs[0]] == [
        [c.token_ids for c in r] for r in runs[1]
    ]
    for choices, p in zip(runs[0], params, strict=True):
        (c,) = choices
        assert c.finish_reason == "length" or len(c.token_ids) >= p.min_tokens
        assert all(0 <= t < V for t in c.token_ids)
    first = runs[0][0][0]
    assert len(first.logprobs) == len(first.token_ids)
    assert all(lp.token_id == t for lp, t in zip(first.logprobs, first.token_ids, strict=True))


def test_the_rejection_rule_keeps_the_models_distribution() -> None:
    """Draft tokens drawn from ``q``, verified against ``p``: each output position is
    distributed as ``p`` after the row's settings (temperature 0.7, top-k 4), whatever
    ``q``."""
    vocab, k, trials = 6, 2, 4000
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(k + 1, vocab, generator=gen) * 1.5  # the model, after each position
    params = SamplingParams(max_tokens=10, temperature=0.7, top_k=4)
    seq = SimpleNamespace(
        request=SimpleNamespace(params=params, prompt_ids=[0]), output_ids=[1], generator=None
    )
    # the reference, by hand: the 4 largest logits over the temperature, softmaxed
    z = logits / 0.7
    z = z.masked_fill(z < z.topk(4, dim=-1).values[:, -1:], float("-inf"))
    p = torch.softmax(z, dim=-1).double()
    # the draft: half the model's distribution, half noise (mass on the tokens top-k drops)
    q = (0.5 * p[:k] + 0.5 * torch.softmax(torch.randn(k, vocab, generator=gen), -1)).float()
    counts = torch.zeros(k + 1, vocab, dtype=torch.float64)
    emitted = torch.zeros(k + 1)
    kept = 0
    for _ in range(trials):
        d = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)]
        a, res = verify_sampled(logits, seq, d, q, eos_ids=set(), generator=gen)
        kept += a
        for pos, r in enumerate(res):
            counts[pos, r.token] += 1
            emitted[pos] += 1
    for pos in range(k + 1):
        observed = counts[pos] / emitted[pos]
        tv = 0.5 * float((observed - p[pos]).abs().sum())
        # twice the mean total variation of an empirical distribution of n draws
        # (at most 0.5 * sqrt(2 V / (pi n))): 0.031 at the first position
        bound = math.sqrt(2 * vocab / (math.pi * float(emitted[pos])))
        assert tv < bound, (pos, emitted[pos], tv, bound)
    # the rule's acceptance: sum(min(p, q)) per position, far above a fixed draft's
    expected = float(torch.minimum(p[0], q.double()[0]).sum())
    assert kept / trials >= 0.8 * expected


def test_draft_settings_are_checked(tokenizer: Any) -> None:
    model = _target()
    small = _first_layers(model, 1)
    with pytest.raises(ValueError, match="give both or neither"):
        Engine(model, tokenizer, speculative="draft")
    with pytest.raises(ValueError, match="give both or neither"):
        Engine(model, tokenizer, speculative="prompt_lookup", draft_model=small)
    torch.manual_seed(0)
    other = DecoderLM(DecoderConfig.llama(**{**ATTN, "vocab_size": V + 8}))
    with pytest.raises(ValueError, match=f"vocabulary of {V + 8} tokens, the model {V}"):
        Engine(model, tokenizer, speculative="draft", draft_model=other)
    mamba = MambaLM(MambaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1))
    with pytest.raises(ValueError, match="recurrent layers"):
        Engine(model, tokenizer, speculative="draft", draft_model=mamba)
    with pytest.raises(ValueError, match="recurrent layers"):
        Engine(mamba, tokenizer, max_model_len=64, speculative="draft", draft_model=small)
    with pytest.raises(TypeError, match="draft_model must be an attnlab decoder"):
        Engine(model, tokenizer, speculative="draft", draft_model=nn.Linear(2, 2))
    mistral = DecoderLM(DecoderConfig.mistral(sliding_window=6, **ATTN))
    with pytest.raises(ValueError, match="sliding-window"):
        Engine(mistral, tokenizer, speculative="draft", draft_model=small)
    with pytest.raises(ValueError, match="int8-channel"):
        Engine(model, tokenizer, kv_dtype="int8-channel", speculative="draft", draft_model=small)


def test_serve_flags(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from attnlab.cli.main import build_parser, main
    from attnlab.cli.serve import _app

    argv = ["serve", str(model_dir), "--speculative", "draft", "--draft-model", str(model_dir)]
    _, info, banner = _app(build_parser().parse_args([*argv, "--num-speculative-tokens", "2"]))
    assert info["speculative"] == {
        "method": "draft",
        "num_tokens": 2,
        "draft_model": str(model_dir),
    }
    assert f"speculative draft of 2 tokens from {model_dir}" in banner
    assert main(["serve", str(model_dir), "--speculative", "draft"]) == 2
    assert "give both or neither" in capsys.readouterr().err
    assert main([*argv[:-1], str(model_dir / "missing")]) == 1
    assert "missing" in capsys.readouterr().err
