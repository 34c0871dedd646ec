"""Structured outputs and tool calls through the official client: every constrained output
parses and validates against its schema, with unconstrained requests in the same batch
unaffected; on random weights and on SmolLM2-135M-Instruct."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from attnlab.serving import Engine  # noqa: E402
from attnlab.serving.server import BackgroundServer, load_engine  # noqa: E402
from attnlab.serving.structured import OutputPlan, ToolStream, parse_tool_calls  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "ok": {"type": "boolean"},
        "tag": {"type": "string", "maxLength": 3},
    },
    "required": ["id", "kind", "ok", "tag"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
MSGS = [{"role": "user", "content": "answer in JSON"}]


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[BackgroundServer]:
    engine, name = load_engine(model_dir, num_blocks=160, block_size=4, max_num_batched_tokens=64)
    with BackgroundServer(engine, model_name=name, max_seconds=300) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> Any:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)


def _name(client: Any) -> str:
    return str(client.models.list().data[0].id)


def _fmt(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def test_json_schema_outputs_validate_beside_unconstrained_requests(
    server: BackgroundServer, client: Any
) -> None:
    name = _name(client)
    eng = server.async_engine.engine
    prompts = [f"class Item{i}:" for i in range(3)]
    results: dict[str, Any] = {}
    errors: list[BaseException] = []

    def constrained(key: str, stream: bool) -> None:
        try:
            kw = dict(model=name, messages=MSGS, max_tokens=60, n=3, temperature=1.0, seed=4)
            if stream:
                texts = {0: "", 1: "", 2: ""}
                for chunk in client.chat.completions.create(
                    **kw, response_format=_fmt(SCHEMA), stream=True
                ):
                    for c in chunk.choices:
                        texts[c.index] += c.delta.content or ""
                results[key] = list(texts.values())
            else:
                r = client.chat.completions.create(**kw, response_format=_fmt(SCHEMA))
                results[key] = [c.message.content for c in r.choices]
        except BaseException as e:
            errors.append(e)

    def plain(i: int) -> None:
        try:
            r = client.completions.create(
                model=name, prompt=prompts[i], max_tokens=10, temperature=0
            )
            results[f"plain{i}"] = r.choices[0].text
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=constrained, args=("whole", False))]
    threads.append(threading.Thread(target=constrained, args=("streamed", True)))
    threads += [threading.Thread(target=plain, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for text in results["whole"] + results["streamed"]:
        jsonschema.validate(json.loads(text), SCHEMA)
    for i, p in enumerate(prompts):
        ids = torch.tensor([eng.tokenizer.encode(p)])
        ref = eng.model.generate(ids, 10, eos_token_id=eng.tokenizer.eos_token_id)[
            0, ids.shape[1] :
        ]
        ref = [t for t in ref.tolist() if t != eng.tokenizer.eos_token_id]
        assert results[f"plain{i}"] == eng.tokenizer.decode(ref, skip_special_tokens=True)
    assert eng.pool.num_used_blocks == 0 or eng.has_work()


def test_completions_take_response_format_too(client: Any) -> None:
    r = client.completions.create(
        model=_name(client),
        prompt="{",
        max_tokens=60,
        temperature=0,
        extra_body={"response_format": _fmt(SCHEMA)},
    )
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


def test_required_and_named_tool_calls(client: Any) -> None:
    name = _name(client)
    r = client.chat.completions.create(
        model=name,
        messages=MSGS,
        max_tokens=80,
        tools=[WEATHER, TIME],
        tool_choice="required",
        temperature=1.0,
        seed=1,
        n=2,
    )
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    one = client.chat.completions.create(
        model=name,
        messages=MSGS,
        max_tokens=80,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=2,
    )
    assert len(one.choices[0].message.tool_calls) == 1
    stream = client.chat.completions.create(
        model=name,
        messages=MSGS,
        max_tokens=40,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "weather"}},
        stream=True,
    )
    args, names, reasons = "", [], []
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                args += d.function.arguments or ""
                if d.function.name:
                    names.append(d.function.name)
            reasons.append(c.finish_reason)
    assert names == ["weather"] and reasons[-1] == "tool_calls"
    jsonschema.validate(json.loads(args), SCHEMAS["weather"])
    # "none": no tool call, and the tools are left out of the prompt
    a = client.chat.completions.create(model=name, messages=MSGS, max_tokens=4, temperature=0)
    b = client.chat.completions.create(
        model=name, messages=MSGS, max_tokens=4, temperature=0, tools=[WEATHER], tool_choice="none"
    )
    assert b.choices[0].message.tool_calls is None
    assert b.choices[0].message.content == a.choices[0].message.content


def test_tool_call_parsing_of_auto_whole_and_streamed() -> None:
    plan = OutputPlan(mode="auto")
    text = 'Let me look. <tool_call>\n{"name": "weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>'
    content, calls = parse_tool_calls(text, plan)
    assert content == "Let me look." and len(calls) == 1
    assert calls[0]["function"]["name"] == "weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome", "days": 2}
    content, calls = parse_tool_calls('{"name": "time", "parameters": {"zone": "UTC"}}', plan)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"zone": "UTC"}
    assert parse_tool_calls("just text", plan) == ("just text", [])
    stream = ToolStream(plan)
    pieces = [
        "Let me",
        " look. <to",
        'ol_call>\n{"name": "weather", ',
        '"arguments": {}}</tool_call>',
    ]
    deltas = [d for p in pieces for d in stream.feed(p)] + stream.finish()
    content_out = "".join(d.get("content", "") for d in deltas)
    tool = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert content_out.strip() == "Let me look." and stream.made_calls
    assert tool[0]["function"]["name"] == "weather" and tool[0]["id"].startswith("call_")


def test_auto_renders_tools_with_a_template_that_supports_them(
    tmp_path: Path, model_dir: Path
) -> None:
    import shutil

    import transformers

    folder = tmp_path / "tools-model"
    shutil.copytree(model_dir, folder)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    tok.chat_template = (
        "{% if tools %}<|system|>tools: {{ tools | tojson }}<|end|>{% endif %}"
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tok.save_pretrained(folder)
    engine, name = load_engine(folder, num_blocks=64, block_size=4)
    with BackgroundServer(engine, model_name=name, max_seconds=120) as srv:
        c = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=60)
        plain = c.chat.completions.create(model=name, messages=MSGS, max_tokens=4, temperature=0)
        tiny = {"type": "function", "function": {"name": "f"}}
        auto = c.chat.completions.create(
            model=name, messages=MSGS, max_tokens=4, temperature=0, tools=[tiny]
        )
        assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 5  # the tools are in
        assert auto.choices[0].finish_reason in ("stop", "length")


def test_smollm2_structured_outputs(smollm2: Any) -> None:
    engine = Engine(smollm2, smollm2.tokenizer, num_blocks=256, max_model_len=1024)
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "country": {"type": "string", "maxLength": 30},
        },
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    ask = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    with BackgroundServer(engine, model_name="smollm2", max_seconds=300) as srv:
        c = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=240)
        r = c.chat.completions.create(
            model="smollm2",
            messages=ask,
            max_tokens=40,
            temperature=0,
            response_format=_fmt(schema),
        )
        answer = json.loads(r.choices[0].message.content)
        jsonschema.validate(answer, schema)
        assert "Paris" in answer["city"]
        obj = c.chat.completions.create(
            model="smollm2",
            messages=ask,
            max_tokens=40,
            temperature=0,
            response_format={"type": "json_object"},
        )
        assert obj.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
        call = c.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "What is the weather in Rome for 3 days?"}],
            max_tokens=40,
            temperature=0,
            tools=[WEATHER],
            tool_choice="required",
        )
        tc = call.choices[0].message.tool_calls[0]
        jsonschema.validate(json.loads(tc.function.arguments), SCHEMAS["weather"])
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="smollm2", messages=ask, max_tokens=4, tools=[WEATHER])
        assert e.value.body["param"] == "tool_choice"  # SmolLM2's template renders no tools
