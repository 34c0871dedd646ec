"""Every request field is honoured (its effect measured against an independent float64 /
transformers loop over the model) or refused with a 400 naming it; content parts; error
objects. Driven by the official ``openai`` client."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
lp = pytest.importorskip("transformers.generation.logits_process")

import attnlab.serving.step_sampling as step_sampling  # noqa: E402
from attnlab.serving.server import BackgroundServer, load_engine  # noqa: E402

PROMPT = "def wrap(text, width"


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[BackgroundServer]:
    engine, name = load_engine(model_dir, num_blocks=128, block_size=4, max_num_batched_tokens=64)
    with BackgroundServer(engine, model_name=name, max_seconds=300) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> Any:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def name(client: Any) -> str:
    return str(client.models.list().data[0].id)


def _reference(
    server: BackgroundServer,
    prompt: str,
    n: int,
    process: Callable[[torch.Tensor, list[int], list[int]], torch.Tensor],
) -> list[int]:
    """Greedy decoding by full forwards in float64, ``process(logits, prompt, output)``."""
    eng = server.async_engine.engine
    ids = list(eng.tokenizer.encode(prompt))
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = eng.model(torch.tensor([ids + out])).logits[0, -1].double()
            out.append(int(process(logits, ids, out).argmax()))
    return out


def _tokens(server: BackgroundServer, text: str) -> list[int]:
    return list(server.async_engine.engine.tokenizer.encode(text))


def _complete(client: Any, name: str, **kw: Any) -> Any:
    kw = {"model": name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 0} | kw
    return client.completions.create(**kw)


def _text(server: BackgroundServer, ids: list[int]) -> str:
    return str(server.async_engine.engine.tokenizer.decode(ids, skip_special_tokens=True))


def test_penalties_and_logit_bias_equal_independent_loops(
    server: BackgroundServer, client: Any, name: str
) -> None:
    def freq_pres(logits: torch.Tensor, prompt: list[int], out: list[int]) -> torch.Tensor:
        x = logits.clone()
        for t in set(out):
            x[t] -= 0.4 + 1.5 * out.count(t)
        return x

    def repetition(logits: torch.Tensor, prompt: list[int], out: list[int]) -> torch.Tensor:
        proc = lp.RepetitionPenaltyLogitsProcessor(1.8)
        return proc(torch.tensor([prompt + out]), logits[None].clone())[0]

    bias = {"7": 30.0, "12": -100.0}

    def biased(logits: torch.Tensor, prompt: list[int], out: list[int]) -> torch.Tensor:
        proc = lp.SequenceBiasLogitsProcessor([[[int(t)], v] for t, v in bias.items()])
        return proc(torch.tensor([prompt + out]), logits[None].clone())[0]

    plain = _reference(server, "aaaa", 12, lambda x, p, o: x)
    cases = [
        ({"frequency_penalty": 1.5, "presence_penalty": 0.4}, freq_pres),
        ({"extra_body": {"repetition_penalty": 1.8}}, repetition),
        ({"logit_bias": bias}, biased),
    ]
    for kw, process in cases:
        extra = kw.pop("extra_body", {})
        r = _complete(
            client,
            name,
            prompt="aaaa",
            max_tokens=12,
            **kw,
            extra_body=extra | {"ignore_eos": True},
        )
        ref = _reference(server, "aaaa", 12, process)
        assert r.choices[0].text == _text(server, ref), kw
        assert ref != plain, kw  # the field changed the output


def test_filters_that_leave_one_token_sample_greedily(
    server: BackgroundServer, client: Any, name: str
) -> None:
    greedy = _complete(client, name, extra_body={"ignore_eos": True}).choices[0].text
    for extra in ({"min_p": 1.0}, {"top_k": 1}, {"temperature": 1e-300}):
        kw: dict[str, Any] = {"temperature": 1.0, "extra_body": {"ignore_eos": True}}
        if "temperature" in extra:
            kw["temperature"] = extra["temperature"]
        else:
            kw["extra_body"] |= extra
        assert _complete(client, name, **kw).choices[0].text == greedy, extra


def test_stop_token_ids_min_tokens_and_include_stop_str(
    server: BackgroundServer, client: Any, name: str
) -> None:
    greedy = _complete(client, name, max_tokens=10, extra_body={"ignore_eos": True})
    ids = _reference(server, PROMPT, 10, lambda x, p, o: x)
    assert greedy.choices[0].text == _text(server, ids)
    stop_tok = ids[2]
    first = ids.index(stop_tok)
    r = _complete(client, name, max_tokens=10, extra_body={"stop_token_ids": [stop_tok]})
    assert r.choices[0].text == _text(server, ids[:first])
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == first + 1

    def banned(logits: torch.Tensor, prompt: list[int], out: list[int]) -> torch.Tensor:
        if len(out) < 6:
            logits = logits.clone()
            logits[stop_tok] = float("-inf")
        return logits

    late = _complete(
        client, name, max_tokens=10, extra_body={"stop_token_ids": [stop_tok], "min_tokens": 6}
    )
    ref = _reference(server, PROMPT, 10, banned)
    end = ref.index(stop_tok, 6) if stop_tok in ref[6:] else len(ref)
    assert late.choices[0].text == _text(server, ref[:end]) and late.usage.completion_tokens >= 6
    text = greedy.choices[0].text
    stop = text[3:6]
    cut = _complete(client, name, max_tokens=10, stop=[stop], extra_body={"ignore_eos": True})
    kept = _complete(
        client,
        name,
        max_tokens=10,
        stop=[stop],
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)]


def test_skip_special_tokens_ignore_eos_and_max_completion_tokens(
    server: BackgroundServer, client: Any, name: str
) -> None:
    eos = server.async_engine.engine.tokenizer.eos_token_id
    force = {"logit_bias": {str(eos): 100}, "max_tokens": 3}
    stopped = _complete(client, name, **force)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    shown = _complete(
        client, name, **force, extra_body={"ignore_eos": True, "skip_special_tokens": False}
    )
    hidden = _complete(client, name, **force, extra_body={"ignore_eos": True})
    assert shown.choices[0].text == "<|endoftext|>" * 3 and hidden.choices[0].text == ""
    msgs = [{"role": "user", "content": "hello"}]
    r = client.chat.completions.create(
        model=name,
        messages=msgs,
        max_completion_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_chat_logprobs_are_the_models_and_n_and_seed(
    server: BackgroundServer, client: Any, name: str
) -> None:
    msgs = [{"role": "user", "content": "hello"}]
    r = client.chat.completions.create(
        model=name,
        messages=msgs,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    eng = server.async_engine.engine
    text = eng.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids = eng.tokenizer.encode(text, add_special_tokens=False)
    with torch.no_grad():
        logp = torch.log_softmax(eng.model(torch.tensor([ids])).logits[0, -1].double(), -1)
    first = r.choices[0].logprobs.content[0]
    assert len(first.top_logprobs) == 3
    assert first.logprob == pytest.approx(float(logp.max()), abs=1e-4)
    assert [t.logprob for t in first.top_logprobs] == pytest.approx(
        logp.topk(3).values.tolist(), abs=1e-4
    )
    kw = dict(model=name, messages=msgs, max_tokens=6, temperature=1.0, n=3, seed=2**63 - 1)
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert len(a.choices) == 3
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]


def test_stream_options_usage(server: BackgroundServer, client: Any, name: str) -> None:
    s = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(s)
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 5
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 5


def test_content_parts_developer_role_and_tool_history(
    server: BackgroundServer, client: Any, name: str
) -> None:
    def say(messages: list[dict[str, Any]]) -> str:
        r = client.chat.completions.create(
            model=name, messages=messages, max_tokens=6, temperature=0
        )
        return str(r.choices[0].message.content)

    plain = say([{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"}])
    parts = say(
        [
            {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ]
    )
    assert parts == plain
    history = [
        {"role": "user", "content": "weather?", "name": "ann"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    assert isinstance(say(history), str)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"best_of": 3}, "best_of"),
        ({"echo": True}, "echo"),
        ({"suffix": "end"}, "suffix"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"guided_json": {}}, "guided_json"),
        ({"seed": 2**64}, "seed"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"min_tokens": 9}, "min_tokens"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": "yes"}, "stream_options"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "strin"}},
                }
            },
            "response_format",
        ),
    ],
)
def test_completion_fields_refused_with_400_naming_them(
    server: BackgroundServer, name: str, extra: dict[str, Any], param: str
) -> None:
    body = {"model": name, "prompt": "hi", "max_tokens": 4} | extra
    r = httpx.post(f"{server.base_url}/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"audio": {"voice": "x"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            },
            "messages[0].content",
        ),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0]"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"},
            "tool_choice",
        ),
        ({"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_chat_fields_refused_with_400_naming_them(
    server: BackgroundServer, name: str, extra: dict[str, Any], param: str
) -> None:
    body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body | extra)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    if "image_url" in str(extra):
        assert "image_url" in err["message"]


def test_no_effect_fields_are_accepted(server: BackgroundServer, client: Any, name: str) -> None:
    a = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    b = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        user="u1",
        metadata={"k": "v"},
        store=False,
    )
    assert a.choices[0].message.content == b.choices[0].message.content


def test_models_and_error_objects(server: BackgroundServer, client: Any, name: str) -> None:
    assert client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    url = server.base_url
    for r, status in (
        (httpx.get(f"{url}/nowhere"), 404),
        (httpx.delete(f"{url}/completions"), 405),
        (httpx.get(f"{url}/completions"), 405),
    ):
        assert r.status_code == status
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    r = httpx.post(f"{url}/completions", content=b"[" * 100_000 + b"]" * 100_000)
    assert r.status_code == 400
    r = httpx.post(
        f"{url}/completions",
        content=b'{"model": "%s", "prompt": "\\ud800", "max_tokens": 2}' % name.encode(),
    )
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]


def test_a_request_that_fails_in_a_step_gets_500_and_the_others_go_on(
    server: BackgroundServer, client: Any, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = step_sampling.sample

    def poisoned(logits: torch.Tensor, rows: list[Any], **kw: Any) -> Any:
        if any(2 in r.settings.logit_bias for r in rows):
            raise RuntimeError("injected fault")
        return real(logits, rows, **kw)

    before = _complete(client, name)
    monkeypatch.setattr(step_sampling, "sample", poisoned)
    with pytest.raises(openai.InternalServerError) as e:
        _complete(client, name, logit_bias={"2": 0.5})
    assert "injected fault" in str(e.value)
    assert _complete(client, name).choices[0].text == before.choices[0].text
    eng = server.async_engine.engine
    assert server.async_engine.alive and eng.pool.num_used_blocks == 0
