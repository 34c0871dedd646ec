"""A server's start (warm-up, frozen heap, the packed linears' log lines) and the per-request
timings the engine hands to the access log."""

from __future__ import annotations

import asyncio
import gc
import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import attnlab
from attnlab.backends.gemm_cache import persisted_choices
from attnlab.backends.linear_pack import clear_gemm_memo
from attnlab.models.inference import pack_model, unpack_model
from attnlab.serving import Engine, SamplingParams
from attnlab.serving.access_log import AccessLog, record_timings, record_usage
from attnlab.serving.startup import freeze_heap, packing_lines, warm_paths


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Any:
    return attnlab.from_hf(model_dir).eval()


def _engine(model: Any, tokenizer: Any) -> Engine:
    return Engine(model, tokenizer, num_blocks=64, block_size=4, max_num_batched_tokens=32, max_num_seqs=8,
                  max_model_len=160)  # fmt: skip


def test_the_request_timings_say_where_the_first_token_went(model: Any, tokenizer: Any) -> None:
    eng = _engine(model, tokenizer)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    eng.add_request("a", list(range(1, 50)), params)  # 49 tokens, 32 a step: two chunks
    eng.add_request("b", list(range(1, 9)), params)
    finished: dict[str, Any] = {}
    for _ in range(50):
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out.timings
        if not eng.has_work():
            break
    assert set(finished) == {"a", "b"}
    a, b = finished["a"], finished["b"]
    assert a["prompt_steps"] == 2 and a["kind"] == "eager" and a["batch"] >= 1
    assert b["prompt_steps"] == 1
    for t in (a, b):
        assert t["queue_ms"] >= 0 and t["prompt_ms"] > 0 and t["step_ms"] >= t["prompt_ms"]
        assert t["first_ms"] >= t["queue_ms"] + t["prompt_ms"]
        assert t["gc_ms"] >= 0 and isinstance(t["arrival"], float)


def test_the_access_log_line_carries_the_timings() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        record_timings({"arrival": 0.0, "first_ms": 5.0})
        record_timings({"arrival": 0.0, "queue_ms": 1.0, "prompt_ms": 2.0, "step_ms": 3.0,
                        "prompt_steps": 1, "kind": "prompt-graph", "batch": 4, "first_ms": 9.0,
                        "gc_ms": 0.0})  # fmt: skip
        record_usage({"prompt_tokens": 3, "completion_tokens": 2})
        await send({"type": "http.response.start", "status": 200})
        await send({"type": "http.response.body", "body": b"x"})

    out = io.StringIO()

    async def send(message: Any) -> None:
        pass

    asyncio.run(
        AccessLog(app, stream=out)({"type": "http", "method": "POST", "path": "/v"}, None, send)
    )  # type: ignore[arg-type]
    line = out.getvalue()
    assert line.startswith("POST /v 200 prompt=3 completion=2 ")
    for field in ("first_byte=", "to_engine=", "queue=1ms", "prompt=2ms(prompt-graph x1, batch 4)",
                  "step=3ms", "first=9ms", "gc=0/"):  # fmt: skip
        assert field in line, (field, line)


def test_warm_up_runs_every_path_and_leaves_the_engine_as_it_was(
    model: Any, tokenizer: Any
) -> None:
    prompt = [5, 9, 2, 33, 7, 1, 8, 8]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = _engine(model, tokenizer).generate([prompt], params)[0][0].token_ids
    eng = _engine(model, tokenizer)
    said = warm_paths(eng)
    assert "warmed with" in said
    assert eng.metrics.requests_received == 0 and eng.metrics.generation_tokens == 0
    assert not eng.has_work() and eng.pool.num_used_blocks == 0
    assert eng.generate([prompt], params)[0][0].token_ids == want
    assert eng.metrics.requests_received == 1


def test_packing_lines_name_each_shape_and_the_stored_decisions(
    model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import attnlab.backends.linear_pack as lp

    monkeypatch.setattr(lp, "_MEASURE_BYTES", 1 << 16)
    clear_gemm_memo()
    assert packing_lines(model) == ["packed linears: none (the float linears run F.linear)"]
    path = tmp_path / "choices.json"
    try:
        with persisted_choices(path) as f:
            pack_model(model, rows=(1, 2))
            first = packing_lines(model, f)
        clear_gemm_memo()
        with persisted_choices(path) as f:
            pack_model(model, rows=(1, 2))
            second = packing_lines(model, f)
    finally:
        unpack_model(model)
        clear_gemm_memo()
    assert "MiB of laid-out copies" in first[0] and "0 decisions read" in first[0]
    assert str(path) in second[0] and "measured now" in second[0]
    import re

    counts = [re.fullmatch(r"  \[\d+, \d+\] x(\d+):( \d+:\S+)+", ln) for ln in first[1:]]
    assert all(counts), first
    layers = int(re.search(r"(\d+) layers", first[0]).group(1))  # type: ignore[union-attr]
    assert sum(int(m.group(1)) for m in counts if m) == layers  # every packed layer, once
    assert any(ln.startswith("  [384, 32] x1:") for ln in first[1:])  # the untied head
    # the second start lays out the same kernels, each read from the file
    assert [ln.replace("*", "") for ln in second[1:]] == first[1:]
    assert all(ln.count("*") == 2 for ln in second[1:])


def test_freeze_heap_moves_the_live_objects_out_of_the_collector() -> None:
    try:
        said = freeze_heap()
        assert gc.get_freeze_count() > 0 and "objects frozen" in said
    finally:
        gc.unfreeze()


def test_the_inductor_cache_variable_is_set_before_anything_compiles(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from attnlab.cli._common import use_inductor_cache

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("ATTNLAB_KERNEL_CACHE", str(tmp_path / "kernels"))
    assert use_inductor_cache() == str(tmp_path / "inductor")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    torch.compile(lambda x: x)  # torch sets it only where it is unset
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere")
    assert use_inductor_cache() == "/somewhere"  # the user's choice is kept


def test_the_warm_gate_answers_503_until_open_except_to_the_warm_up() -> None:
    from attnlab.serving.http_warmup import WARM_HEADER, WarmGate

    seen: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    gate = WarmGate(app)

    def call(headers: list[tuple[bytes, bytes]]) -> int:
        sent: list[Any] = []

        async def send(message: Any) -> None:
            sent.append(message)

        scope = {"type": "http", "path": "/v1/models", "headers": headers}
        asyncio.run(gate(scope, None, send))  # type: ignore[arg-type]
        return int(sent[0]["status"])

    assert call([]) == 503 and not seen
    assert call([(WARM_HEADER, b"1")]) == 200 and seen == ["/v1/models"]
    gate.open()
    assert call([]) == 200
