"""Structured outputs and tool calls of the chat API: ``response_format``, ``tools`` and
``tool_choice`` turned into a grammar, and the generated text turned back into
``tool_calls`` (whole, or as streaming deltas).

- ``response_format``: ``text``; ``json_object`` (any JSON object); ``json_schema``
  (valid against the schema), by grammar-constrained decoding
  (:mod:`attnlab.generation.grammar`).
- ``tool_choice``: ``"none"`` (tools are left out of the prompt, no calls); a named
  function (the output is constrained to the function's ``parameters`` and returned as
  its arguments); ``"required"`` (constrained to a JSON list of ``{"name", "parameters"}``
  calls of the given tools, as vLLM does; one call when ``parallel_tool_calls`` is false);
  ``"auto"`` (the tools are rendered by the model's chat template, which must support
  them, and calls are parsed from the text in the Hermes format,
  ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (Qwen 2.5, Hermes,
  SmolLM3), or as one JSON object ``{"name": ..., "parameters"|"arguments": ...}``
  (Llama 3.x)).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from attnlab.serving.protocol import APIError

__all__ = ["OutputPlan", "ToolStream", "output_plan", "parse_tool_calls"]

_TOOL_OPEN = "<tool_call>"
_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


@dataclass
class OutputPlan:
    """How a request's output is constrained and read back.

    Attributes:
        grammar: the compiled grammar, or None.
        mode: ``"text"``, ``"named"``, ``"required"`` or ``"auto"``.
        tools: the tools to render in the prompt (None: none).
        function: the named function (mode ``"named"``).
        schema: the source of the grammar (for the caller's records).
    """

    grammar: Any = None
    mode: str = "text"
    tools: list[dict[str, Any]] | None = None
    function: str | None = None
    schema: dict[str, Any] | None = field(default=None, repr=False)


def _tools(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise APIError(400, "tools must be a non-empty list", param="tools")
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) else None
        if (
            t.get("type") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
        ):
            raise APIError(
                400,
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                param=f"tools[{i}]",
            )
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise APIError(
                400, f"tools[{i}].function.parameters must be an object", param=f"tools[{i}]"
            )
    return raw


def _params_schema(tool: dict[str, Any]) -> dict[str, Any]:
    schema = tool["function"].get("parameters") or {"type": "object"}
    return dict(schema)


def _required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "parameters": _params_schema(t),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _response_format(raw: Any) -> tuple[str, dict[str, Any] | None]:
    """``("text" | "json_object" | "json_schema", schema)``."""
    if raw is None:
        return "text", None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "text":
        return "text", None
    if kind == "json_object":
        return "json_object", {"type": "object"}
    if kind == "json_schema":
        spec = raw.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(
                400,
                "response_format.json_schema.schema must be a JSON schema object",
                param="response_format",
            )
        return "json_schema", schema
    raise APIError(
        400,
        f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
        param="response_format",
    )


def _template_has_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(str(v) for v in template.values())
    return "tools" in str(template)


def output_plan(body: dict[str, Any], tokenizer: Any, vocab_size: int, *, chat: bool) -> OutputPlan:
    """Read ``response_format``, ``tools``, ``tool_choice`` and compile the grammar.

    Slow for a large schema (compiling runs in llguidance, outside the GIL): call it from
    a worker thread.

    Raises:
        APIError: 400 naming the field: a bad value, a schema the grammar library cannot
            compile (with its reason), ``auto`` with a template that has no tool support.
    """
    from attnlab.generation.grammar import Grammar, GrammarError

    kind, schema = _response_format(body.get("response_format"))
    plan = OutputPlan()
    raw_tools = body.get("tools") if chat else None
    choice = body.get("tool_choice") if chat else None
    if raw_tools is None and choice not in (None, "none"):
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    if raw_tools is not None:
        tools = _tools(raw_tools)
        names = [t["function"]["name"] for t in tools]
        choice = "auto" if choice is None else choice
        parallel = body.get("parallel_tool_calls")
        if parallel is not None and not isinstance(parallel, bool):
            raise APIError(
                400, "parallel_tool_calls must be a boolean", param="parallel_tool_calls"
            )
        if isinstance(choice, dict):
            name = (
                (choice.get("function") or {}).get("name")
                if choice.get("type") == "function"
                else None
            )
            if name not in names:
                raise APIError(
                    400,
                    f"tool_choice names {name!r}, not one of the tools {names}",
                    param="tool_choice",
                )
            plan = OutputPlan(mode="named", function=name, tools=tools)
            schema = _params_schema(tools[names.index(name)])
        elif choice == "required":
            plan = OutputPlan(mode="required", tools=tools)
            schema = _required_schema(tools, parallel is not False)
        elif choice == "auto":
            if not _template_has_tools(tokenizer):
                raise APIError(
                    400,
                    "tool_choice 'auto' needs a chat template that renders tools; this model's "
                    "has none (use tool_choice 'required' or a named function)",
                    param="tool_choice",
                )
            plan = OutputPlan(mode="auto", tools=tools)
        elif choice != "none":
            raise APIError(400, f"tool_choice {choice!r} is not supported", param="tool_choice")
        if plan.mode in ("named", "required") and kind != "text":
            raise APIError(
                400,
                "response_format and a forced tool_choice both constrain the output",
                param="response_format",
            )
    if schema is None:
        return plan
    try:
        plan.grammar = Grammar.json_schema(schema, tokenizer, vocab_size)
    except GrammarError as e:
        param = "response_format" if plan.mode == "text" else "tools"
        raise APIError(400, f"the schema cannot be compiled: {e}", param=param) from None
    plan.schema = schema
    return plan


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


def _parsed(obj: Any) -> dict[str, Any] | None:
    if isinstance(obj, dict) and isinstance(obj.get("name"), str):
        args = obj.get("arguments", obj.get("parameters", {}))
        return _call(obj["name"], args)
    return None


def parse_tool_calls(text: str, plan: OutputPlan) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` read from a choice's text under ``plan``."""
    if plan.mode == "named":
        return None, [_call(plan.function or "", text)]
    if plan.mode == "required":
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        calls = (
            [c for c in (_parsed(i) for i in items) if c is not None]
            if isinstance(items, list)
            else []
        )
        return (None, calls) if calls else (text, [])
    if plan.mode != "auto":
        return text, []
    calls = []
    for m in _HERMES.finditer(text):
        try:
            call = _parsed(json.loads(m.group(1)))
        except json.JSONDecodeError:
            call = None
        if call is not None:
            calls.append(call)
    if calls:
        rest = _HERMES.sub("", text).strip()
        return (rest or None), calls
    try:
        call = _parsed(json.loads(text.strip()))
    except json.JSONDecodeError:
        call = None
    return (None, [call]) if call is not None else (text, [])


class ToolStream:
    """Turns one choice's text pieces into chat-completion deltas under ``plan``."""

    def __init__(self, plan: OutputPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of text sent as content
        self.call_id = f"call_{uuid.uuid4().hex[:24]}"
        self.named_started = False
        self.made_calls = False

    def _safe(self) -> int:
        """How far content may be sent: up to where a tool call starts or may start."""
        if self.text.lstrip().startswith("{"):  # a JSON tool call, or JSON content: wait
            return self.sent
        start = self.text.find(_TOOL_OPEN, self.sent)
        if start >= 0:
            return start
        for i in range(max(self.sent, len(self.text) - len(_TOOL_OPEN) + 1), len(self.text)):
            if _TOOL_OPEN.startswith(self.text[i:]):
                return i
        return len(self.text)

    def feed(self, piece: str) -> list[dict[str, Any]]:
        """The deltas for a new piece of text."""
        self.text += piece
        mode = self.plan.mode
        if mode == "text":
            return [{"content": piece}] if piece else []
        if mode == "named":
            out = []
            if not self.named_started:
                self.named_started = self.made_calls = True
                out.append(
                    {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": self.call_id,
                                "type": "function",
                                "function": {"name": self.plan.function, "arguments": ""},
                            }
                        ]
                    }
                )
            if piece:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
            return out
        if mode == "auto":
            safe = self._safe()
            out_text = self.text[self.sent : safe]
            self.sent = max(self.sent, safe)
            return [{"content": out_text}] if out_text else []
        return []  # required, or a possible tool call: wait for the end

    def finish(self) -> list[dict[str, Any]]:
        """The deltas at the end of the choice (held text, parsed calls)."""
        mode = self.plan.mode
        if mode in ("text", "named"):
            return [] if mode == "text" or self.named_started else self.feed("")
        content, calls = parse_tool_calls(self.text[self.sent :], self.plan)
        out: list[dict[str, Any]] = []
        if content:
            out.append({"content": content})
        for i, call in enumerate(calls):
            out.append({"tool_calls": [{"index": i} | call]})
        self.made_calls = bool(calls)
        self.sent = len(self.text)
        return out
