"""``attnlab serve``'s app on SmolLM2-135M-Instruct, driven by the official OpenAI client."""

from __future__ import annotations

import io
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from attnlab.serving.engine import Engine  # noqa: E402
from attnlab.serving.server import BackgroundServer  # noqa: E402


def test_chat_answers_and_each_request_is_logged(smollm2: Any) -> None:
    log = io.StringIO()
    engine = Engine(smollm2, smollm2.tokenizer, num_blocks=64, block_size=16)
    server = BackgroundServer(
        engine, model_name="SmolLM2-135M-Instruct", max_seconds=120, access_log=log
    )
    with server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0,
        )
        assert "Paris" in (reply.choices[0].message.content or "")
        assert [m.id for m in client.models.list()] == ["SmolLM2-135M-Instruct"]
        stream = client.completions.create(
            model="SmolLM2-135M-Instruct", prompt="The sky is", max_tokens=5, stream=True
        )
        streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert streamed
    lines = log.getvalue().splitlines()
    chat = next(line for line in lines if "/v1/chat/completions" in line)
    n = reply.usage.prompt_tokens if reply.usage else -1
    assert chat.startswith("POST /v1/chat/completions 200 ")
    assert f"prompt={n} completion={reply.usage.completion_tokens if reply.usage else -1}" in chat
    assert any(line.startswith("GET /v1/models 200 prompt=- completion=-") for line in lines)
    # a stream is logged when it ends, with its counts
    assert any(line.startswith("POST /v1/completions 200 prompt=3 completion=5 ") for line in lines)
