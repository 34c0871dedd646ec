"""Class A of issue 22, server side: a client's mistake is a 4xx, never a 500; a client that
hangs up has its request aborted, streaming or not; ``/metrics`` gauges return to idle;
``attnlab serve`` on a port in use exits 1 with one line."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from attnlab.cli.main import main  # noqa: E402
from attnlab.serving.server import BackgroundServer, load_engine  # noqa: E402

KEY = "fault-key"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[BackgroundServer]:
    engine, name = load_engine(model_dir, num_blocks=96, block_size=4, max_num_batched_tokens=64)
    with BackgroundServer(engine, model_name=name, api_key=KEY, max_seconds=300) as srv:
        yield srv


def _name(server: BackgroundServer) -> str:
    r = httpx.get(f"{server.base_url}/models", headers=AUTH)
    return str(r.json()["data"][0]["id"])


def _post(server: BackgroundServer, path: str, content: bytes | str) -> Any:
    data = content.encode() if isinstance(content, str) else content
    return httpx.post(f"{server.base_url}{path}", content=data, headers=AUTH, timeout=60)


def _bad_bodies(name: str) -> list[tuple[str, str, str]]:
    deep = "[" * 100_000 + "]" * 100_000
    surrogate = '"\\ud800"'  # JSON's escape of a lone surrogate
    chat = f'{{"model": "{name}", "messages": [{{"role": "user", "content": "hi"}}]'
    return [
        ("/completions", f'{{"model": "{name}", "prompt": {deep}}}', "nested too deeply"),
        ("/completions", deep, "nested too deeply"),
        ("/completions", f'{{"model": "{name}", "prompt": {surrogate}}}', "prompt"),
        ("/completions", f'{{"model": "{name}", "prompt": ["ok", {surrogate}]}}', "prompt[1]"),
        (
            "/chat/completions",
            f'{{"model": "{name}", "messages": [{{"role": "user", "content": {surrogate}}}]}}',
            "messages[0].content",
        ),
        ("/chat/completions", chat + f', "user": {surrogate}}}', "user"),
        (
            "/completions",
            f'{{"model": "{name}", "prompt": "hi", "stream": true, "stream_options": "yes"}}',
            "stream_options",
        ),
        ("/chat/completions", chat + ', "stream": true, "stream_options": [1]}', "stream_options"),
        (
            "/completions",
            f'{{"model": "{name}", "prompt": "hi", "stream": true, "stream_options": {{"include_usage": "x"}}}}',
            "include_usage",
        ),
    ]


def test_client_mistakes_are_400_naming_the_field(server: BackgroundServer) -> None:
    for path, body, needle in _bad_bodies(_name(server)):
        r = _post(server, path, body)
        assert r.status_code == 400, (path, body[:80], r.status_code, r.text[:200])
        assert needle in r.text, (needle, r.text[:300])
    # the server goes on
    ok = _post(
        server, "/completions", json.dumps({"model": _name(server), "prompt": "a", "max_tokens": 2})
    )
    assert ok.status_code == 200, ok.text


def _gauge(server: BackgroundServer, name: str) -> float:
    text = httpx.get(server.base_url.removesuffix("/v1") + "/metrics").text
    found = re.search(rf"^attnlab_{name} (\S+)$", text, re.M)
    assert found is not None, name
    return float(found.group(1))


def _wait(cond: Any, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_a_non_streaming_client_that_hangs_up_is_aborted(
    server: BackgroundServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    eng = server.async_engine.engine
    real = eng.step

    def slow_step() -> Any:  # a step of a real model: long enough to notice the client left
        time.sleep(0.02)
        return real()

    monkeypatch.setattr(eng, "step", slow_step)
    aborted, generated = eng.metrics.requests_aborted, eng.metrics.generation_tokens
    body = json.dumps(
        {"model": _name(server), "prompt": "hello", "max_tokens": 150, "ignore_eos": True}
    ).encode()
    host, port = server.base_url.removeprefix("http://").split("/")[0].split(":")
    with socket.create_connection((host, int(port))) as s:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        s.sendall(head.encode() + body)
        assert _wait(lambda: eng.metrics.generation_tokens > generated + 2)
    assert _wait(lambda: eng.metrics.requests_aborted == aborted + 1)
    assert eng.metrics.generation_tokens - generated < 150  # not every token was generated
    assert _wait(lambda: eng.pool.num_used_blocks == 0 and not eng.requests)
    # the gauges are back at their idle values, though no step ran after the abort
    assert _gauge(server, "requests_running") == 0
    assert _gauge(server, "requests_waiting") == 0
    assert _gauge(server, "kv_blocks_used") == 0


def test_gauges_return_to_idle_after_a_dropped_stream(server: BackgroundServer) -> None:
    body = {
        "model": _name(server),
        "prompt": "hi",
        "max_tokens": 100,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{server.base_url}/completions", json=body, headers=AUTH, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    assert _wait(lambda: _gauge(server, "requests_running") == 0)
    assert _gauge(server, "kv_blocks_used") == 0 and _gauge(server, "kv_waste_ratio") == 0


def test_serve_on_a_port_in_use_exits_1_with_one_line(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["serve", str(model_dir), "--port", str(port)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attnlab serve: error: --port"), err
    assert "in use" in err[0], err
