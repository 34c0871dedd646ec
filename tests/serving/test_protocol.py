"""The field tables are the contract: docs/serving.md prints them, every field has a status."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnlab.serving.protocol import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    APIError,
    chat_messages,
    check_fields,
    compatibility_table,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


def test_the_docs_print_the_servers_own_field_table() -> None:
    text = DOC.read_text()
    start = text.index("<!-- fields: attnlab.serving.protocol.compatibility_table() -->")
    end = text.index("<!-- /fields -->")
    assert text[start:end].split("\n", 1)[1].strip() == compatibility_table().strip()


def test_fields_are_refused_unless_they_change_nothing() -> None:
    check_fields(
        {"model": "m", "echo": False, "suffix": None, "best_of": 2, "n": 2}, COMPLETION_FIELDS
    )
    check_fields({"model": "m", "modalities": ["text"], "user": "u", "store": True}, CHAT_FIELDS)
    for body, param in (
        ({"echo": True}, "echo"),
        ({"best_of": 2}, "best_of"),
        ({"suffix": "x"}, "suffix"),
        ({"nonsense": 1}, "nonsense"),
    ):
        with pytest.raises(APIError) as e:
            check_fields(body, COMPLETION_FIELDS)
        assert e.value.status == 400 and e.value.param == param
    with pytest.raises(APIError) as e:
        check_fields({"modalities": ["audio"]}, CHAT_FIELDS)
    assert e.value.param == "modalities"


def test_messages_take_text_parts_and_null_assistant_content() -> None:
    msgs = chat_messages(
        [
            {
                "role": "developer",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"x": 1}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "1", "content": "ok"},
        ]
    )
    assert msgs[0] == {"role": "system", "content": "a\nb"}
    assert msgs[1]["content"] == "" and msgs[1]["tool_calls"][0]["function"]["arguments"] == {
        "x": 1
    }
    assert msgs[2]["tool_call_id"] == "1"
    for bad, where in (
        ([{"role": "user", "content": [{"type": "input_audio"}]}], "input_audio"),
        ([{"role": "user", "content": None}], "content"),
        ([{"role": "tool", "content": "x"}], "tool_call_id"),
    ):
        with pytest.raises(APIError) as e:
            chat_messages(bad)
        assert where in e.value.message
