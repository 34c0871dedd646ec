"""The engine in its own process (``attnlab serve``'s default layout): the same answers as
the engine in a thread, one bad request failing alone, aborts freeing blocks, ``/metrics``
and ``/health`` from the core, and no engine process outliving its server."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from attnlab.serving.engine_client import EngineProcess  # noqa: E402
from attnlab.serving.params import ParamError, SamplingParams  # noqa: E402
from attnlab.serving.server import BackgroundServer, load_engine  # noqa: E402

SETTINGS = dict(num_blocks=96, block_size=4, max_num_batched_tokens=64)


def _factory(model_dir: Path) -> Any:
    return functools.partial(load_engine, model_dir, **SETTINGS)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[BackgroundServer]:
    proc = EngineProcess(_factory(model_dir), threads=1)
    with BackgroundServer(proc, model_name="tiny", max_seconds=300) as srv:
        yield srv
    assert proc.process.poll() is not None  # the core stopped with the server


def _post(server: BackgroundServer, path: str, body: dict[str, Any]) -> Any:
    return httpx.post(f"{server.base_url}{path}", json={"model": "tiny", **body}, timeout=60)


def _metric(server: BackgroundServer, name: str) -> float:
    text = httpx.get(server.base_url.removesuffix("/v1") + "/metrics", timeout=30).text
    line = next(x for x in text.splitlines() if x.startswith(f"attnlab_{name} "))
    return float(line.split()[1])


def _wait(cond: Any, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_answers_equal_the_engine_in_a_thread(server: BackgroundServer, model_dir: Path) -> None:
    engine, _ = load_engine(model_dir, **SETTINGS)
    prompts = ["def wrap(text, width", "import string"]
    ref = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0))
    seeded = SamplingParams(max_tokens=10, temperature=0.8, seed=7, n=2, ignore_eos=True)
    ref_seeded = engine.generate([prompts[0]], seeded)[0]
    for prompt, want in zip(prompts, ref, strict=True):
        r = _post(server, "/completions", {"prompt": prompt, "max_tokens": 10, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want[0].text
        body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "stream": True}
        with httpx.stream(
            "POST", f"{server.base_url}/completions", json={"model": "tiny", **body}
        ) as s:
            events = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: {")]
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events) == want[0].text
    body = {"prompt": prompts[0], "max_tokens": 10, "temperature": 0.8, "seed": 7, "n": 2}
    r = _post(server, "/completions", body | {"ignore_eos": True})
    got = sorted((c["index"], c["text"]) for c in r.json()["choices"])
    assert [t for _, t in got] == [c.text for c in ref_seeded]


def test_chat_a_grammar_and_a_bad_request_failing_alone(server: BackgroundServer) -> None:
    msgs = [{"role": "user", "content": "say something"}]
    r = _post(server, "/chat/completions", {"messages": msgs, "max_tokens": 6})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    # the grammar is compiled again in the core (a compiled grammar does not pickle)
    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}
    r = _post(
        server, "/chat/completions", {"messages": msgs, "max_tokens": 8, "response_format": schema}
    )
    assert r.status_code == 200
    text = r.json()["choices"][0]["message"]["content"]
    assert text == "" or text.lstrip("-").isdigit(), text
    r = _post(server, "/completions", {"prompt": "x" * 3000, "max_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] in ("prompt", "max_tokens")
    r = _post(server, "/completions", {"prompt": "hi", "max_tokens": 4})
    assert r.status_code == 200  # the engine goes on
    assert httpx.get(server.base_url.removesuffix("/v1") + "/health").json() == {"status": "ok"}


def test_a_dropped_stream_is_aborted_and_its_blocks_freed(server: BackgroundServer) -> None:
    aborted = _metric(server, "requests_aborted_total")
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 150, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    assert _wait(lambda: _metric(server, "requests_aborted_total") == aborted + 1)
    assert _metric(server, "kv_blocks_used") == 0 and _metric(server, "requests_running") == 0


def test_the_core_refuses_a_request_alone_and_goes_on(server: BackgroundServer) -> None:
    """Past the API's checks (called directly, on the server's loop): the core's refusal
    reaches that request's stream as the engine's own error, and the next one is served."""
    proc = server.async_engine

    async def drive() -> list[int]:
        with pytest.raises(ParamError, match="vocab|token"):
            async for _ in proc.generate("bad", [10**6], SamplingParams(max_tokens=2)):
                pass
        toks: list[int] = []
        async for out in proc.generate("ok", [5, 6, 7], SamplingParams(max_tokens=3)):
            toks += out.outputs[0].token_ids
        return toks

    assert proc._loop is not None
    done = asyncio.run_coroutine_threadsafe(drive(), proc._loop)
    assert len(done.result(60)) == 3


def test_the_core_dies_with_its_server(model_dir: Path, tmp_path: Path) -> None:
    """A server killed without a shutdown (``os._exit``) leaves no engine process."""
    script = tmp_path / "orphan.py"
    script.write_text(
        "import functools, os, sys\n"
        "from attnlab.serving.engine_client import EngineProcess\n"
        "from attnlab.serving.server import load_engine\n"
        f"p = EngineProcess(functools.partial(load_engine, {str(model_dir)!r}, num_blocks=32))\n"
        "print(p.info['pid'], flush=True)\n"
        "os._exit(0)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env
    )
    pid = int(out.stdout.split()[0])

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as f:  # a zombie (reparented, not yet reaped)
            return f.read().split(")")[-1].split()[0] == "Z"

    assert _wait(gone, timeout=30)
