"""The OpenAI-compatible server, driven by the official ``openai`` client."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from attnlab.serving.server import BackgroundServer, load_engine  # noqa: E402

KEY = "test-key"


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[BackgroundServer]:
    engine, name = load_engine(model_dir, num_blocks=96, block_size=4, max_num_batched_tokens=64)
    with BackgroundServer(engine, model_name=name, api_key=KEY, max_seconds=300) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)


def _offline(server: BackgroundServer, prompt: str, n: int) -> list[int]:
    eng = server.async_engine.engine
    ids = torch.tensor([eng.tokenizer.encode(prompt)])
    out = eng.model.generate(ids, n, eos_token_id=eng.tokenizer.eos_token_id)
    return out[0, ids.shape[1] :].tolist()


def _wait_idle(server: BackgroundServer, timeout: float = 30.0) -> None:
    eng = server.async_engine.engine
    deadline = time.monotonic() + timeout
    while (eng.has_work() or eng.pool.num_used_blocks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert eng.pool.num_used_blocks == 0 and not eng.requests


def test_greedy_completion_equals_offline_generate_and_streams_the_same_text(
    server: BackgroundServer, client: openai.OpenAI
) -> None:
    name = client.models.list().data[0].id
    prompt = "def wrap(text, width"
    r = client.completions.create(
        model=name, prompt=prompt, max_tokens=12, temperature=0, logprobs=1
    )
    ref = _offline(server, prompt, 12)
    tok = server.async_engine.engine.tokenizer
    ref_text = tok.decode(
        ref[:-1] if ref[-1] == tok.eos_token_id else ref, skip_special_tokens=True
    )
    assert r.choices[0].text == ref_text
    assert r.usage.completion_tokens == len(ref)
    assert r.usage.prompt_tokens == len(tok.encode(prompt))
    assert r.choices[0].finish_reason == ("stop" if ref[-1] == tok.eos_token_id else "length")
    assert len(r.choices[0].logprobs.token_logprobs) == len(ref)
    stream = client.completions.create(
        model=name,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == len(ref)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[
        0
    ].finish_reason
    _wait_idle(server)


def test_seeded_n2_sampling_is_reproducible_and_chat_works(
    server: BackgroundServer, client: openai.OpenAI
) -> None:
    name = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "wrap this text"}]
    kw = dict(model=name, messages=msgs, max_tokens=10, n=2, seed=11, temperature=1.0, top_p=0.95)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert {c.index for c in a.choices} == {0, 1} and a.choices[0].message.role == "assistant"
    assert 2 <= a.usage.completion_tokens <= 20
    assert a.usage.total_tokens == a.usage.prompt_tokens + a.usage.completion_tokens
    streamed = client.chat.completions.create(**kw, stream=True)
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert [texts[0], texts[1]] == [c.message.content for c in a.choices]
    _wait_idle(server)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10_000}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": "two"}, "n"),
        ({"prompt": "word " * 400}, "prompt"),
        ({"prompt": 5}, "prompt"),
    ],
)
def test_bad_requests_get_400_naming_the_field(
    server: BackgroundServer, client: openai.OpenAI, body: dict, param: str
) -> None:
    name = client.models.list().data[0].id
    req = {"model": name, "prompt": "hi", "max_tokens": 4} | body
    r = httpx.post(
        f"{server.base_url}/completions", json=req, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_an_unknown_model_gets_404_model_not_found(server: BackgroundServer) -> None:
    body = {"model": "gpt-9", "prompt": "hi", "max_tokens": 4}
    r = httpx.post(
        f"{server.base_url}/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    )
    err = r.json()["error"]
    assert r.status_code == 404 and err["param"] == "model" and err["code"] == "model_not_found"


def test_auth_json_health_and_metrics(server: BackgroundServer) -> None:
    url = server.base_url
    assert httpx.get(f"{url}/models").status_code == 401
    r = httpx.post(
        f"{url}/completions", content=b"{oops", headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    root = url.removesuffix("/v1")
    assert httpx.get(f"{root}/health").json() == {"status": "ok"}
    text = httpx.get(f"{root}/metrics").text
    for name in (
        "kv_blocks_used",
        "kv_blocks_free",
        "kv_cache_hit_rate",
        "kv_waste_ratio",
        "requests_running",
        "requests_waiting",
        "tokens_per_second",
        "time_to_first_token_seconds_count",
        "steps_by_kind_total",
    ):
        assert f"attnlab_{name}" in text


def test_disconnect_aborts_and_frees_blocks(server: BackgroundServer) -> None:
    eng = server.async_engine.engine
    aborted = eng.metrics.requests_aborted
    body = {
        "model": _model_name(server),
        "prompt": "hello",
        "max_tokens": 150,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        f"{server.base_url}/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one event, then hang up
    _wait_idle(server)
    assert eng.metrics.requests_aborted == aborted + 1


def _model_name(server: BackgroundServer) -> str:
    r = httpx.get(f"{server.base_url}/models", headers={"Authorization": f"Bearer {KEY}"})
    return str(r.json()["data"][0]["id"])


def test_small_load_all_streams_complete_and_blocks_return(server: BackgroundServer) -> None:
    name = _model_name(server)
    # fresh connections: none left idle by the other tests
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)
    prompts = [f"class Wrapper{i}:" for i in range(8)]
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            s = client.completions.create(
                model=name, prompt=prompts[i], max_tokens=8, temperature=0, stream=True
            )
            results[i] = "".join(c.choices[0].text for c in s if c.choices)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, [(e, e.__cause__) for e in errors]
    assert len(results) == len(prompts)
    tok = server.async_engine.engine.tokenizer
    for i, p in enumerate(prompts):
        ref = [t for t in _offline(server, p, 8) if t != tok.eos_token_id]
        assert results[i] == tok.decode(ref, skip_special_tokens=True)
    _wait_idle(server)


def test_a_full_queue_gets_429(model_dir: Path) -> None:
    engine, name = load_engine(model_dir, num_blocks=16, block_size=4, max_waiting=0)
    with BackgroundServer(engine, model_name=name, max_seconds=60) as srv:
        c = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model=name, prompt="hi", max_tokens=2)
        assert e.value.status_code == 429
