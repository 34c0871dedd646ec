"""The OpenAI request formats: which fields are honoured, refused or have no effect, and
how a request body becomes :class:`~attnlab.serving.params.SamplingParams` and messages.

The rule: a field that would change the output is honoured exactly or refused with a 400
naming it; only fields with no effect on the output (``user``, ``metadata``, ``store``,
...) are accepted silently. A field this server does not know is refused too. The tables
below are the server's whole contract; ``docs/serving.md`` prints them as a table and a
test keeps the two equal.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from attnlab.serving.params import ParamError, SamplingParams

__all__ = [
    "CHAT_FIELDS",
    "COMPLETION_FIELDS",
    "EMBEDDING_FIELDS",
    "APIError",
    "StreamOptions",
    "chat_messages",
    "check_fields",
    "check_text",
    "compatibility_table",
    "sampling_params",
    "stream_options",
]


class APIError(Exception):
    """An error answered as an OpenAI error object."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = {
            401: "authentication_error",
            403: "permission_error",
            404: "not_found_error",
            429: "rate_limit_error",
        }.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


class _Only:
    """A field accepted only at the values that change nothing (null and ``defaults``)."""

    def __init__(self, *defaults: Any, text: str | None = None) -> None:
        self.defaults = defaults
        self.accepted = text or " or ".join(["null", *(json.dumps(d) for d in defaults)])

    def __call__(self, value: Any, body: dict[str, Any]) -> bool:
        return value is None or any(value == d and type(value) is type(d) for d in self.defaults)


class _BestOf(_Only):
    def __call__(self, value: Any, body: dict[str, Any]) -> bool:
        return value is None or (
            isinstance(value, int) and not isinstance(value, bool) and value == body.get("n", 1)
        )


_absent = _Only
_best_of = _BestOf(text="null or equal to n")


#: ``"honoured"``; ``"no effect"`` (accepted, changes nothing in the output); or a check
#: of the values accepted because they are the default (others are refused: not supported).
FieldRule = str | _Only

_SAMPLING: dict[str, FieldRule] = {
    "model": "honoured",
    "max_tokens": "honoured",
    "temperature": "honoured",
    "top_p": "honoured",
    "n": "honoured",
    "stream": "honoured",
    "stream_options": "honoured",
    "stop": "honoured",
    "seed": "honoured",
    "presence_penalty": "honoured",
    "frequency_penalty": "honoured",
    "logit_bias": "honoured",
    "response_format": "honoured",
    # vLLM's extensions
    "top_k": "honoured",
    "min_p": "honoured",
    "repetition_penalty": "honoured",
    "min_tokens": "honoured",
    "stop_token_ids": "honoured",
    "ignore_eos": "honoured",
    "include_stop_str_in_output": "honoured",
    "skip_special_tokens": "honoured",
    # no effect on the output
    "user": "no effect",
    "service_tier": "no effect",
    "prompt_cache_key": "no effect",
    "safety_identifier": "no effect",
}

COMPLETION_FIELDS: dict[str, FieldRule] = _SAMPLING | {
    "prompt": "honoured",
    "logprobs": "honoured",
    "echo": _absent(False),
    "suffix": _absent(""),
    "best_of": _best_of,
    "prompt_logprobs": _absent(),
}

CHAT_FIELDS: dict[str, FieldRule] = _SAMPLING | {
    "messages": "honoured",
    "max_completion_tokens": "honoured",
    "logprobs": "honoured",
    "top_logprobs": "honoured",
    "tools": "honoured",
    "tool_choice": "honoured",
    "parallel_tool_calls": "honoured",
    "add_generation_prompt": "honoured",
    "continue_final_message": "honoured",
    "metadata": "no effect",
    "store": "no effect",
    "functions": _absent(),
    "function_call": _absent(),
    "audio": _absent(),
    "modalities": _absent(["text"]),
    "prediction": _absent(),
    "reasoning_effort": _absent(),
    "verbosity": _absent(),
    "web_search_options": _absent(),
    "prompt_logprobs": _absent(),
    "chat_template_kwargs": _absent({}),
}

EMBEDDING_FIELDS: dict[str, FieldRule] = {
    "model": "honoured",
    "input": "honoured",
    "encoding_format": "honoured",
    "dimensions": "honoured",
    "user": "no effect",
}


def _status(rule: FieldRule | None) -> str:
    if rule is None:
        return "refused"
    if isinstance(rule, _Only):
        return f"refused unless {rule.accepted}"
    return rule


def compatibility_table() -> str:
    """The fields of the three endpoints as a markdown table (printed in docs/serving.md)."""
    tables = (COMPLETION_FIELDS, CHAT_FIELDS, EMBEDDING_FIELDS)
    names = sorted({n for t in tables for n in t}, key=lambda n: (n != "model", n))
    lines = [
        "| field | `/v1/completions` | `/v1/chat/completions` | `/v1/embeddings` |",
        "|---|---|---|---|",
    ]
    for n in names:
        lines.append(f"| `{n}` | " + " | ".join(_status(t.get(n)) for t in tables) + " |")
    lines.append("| any other field | refused | refused | refused |")
    return "\n".join(lines)


def check_text(body: Any) -> None:
    """Refuse strings that are not Unicode text (a lone surrogate such as ``"\\ud800"``),
    naming where it is (``messages[0].content``)."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                where = path or "the body"
                raise APIError(
                    400,
                    f"{where} holds a string that is not valid Unicode (a lone surrogate)",
                    param=path or None,
                ) from None
        elif isinstance(item, dict):
            for k, v in item.items():
                stack.append((f"{path}.{k}" if path else str(k), v))
                stack.append((path or "a key", k))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(item))


def check_fields(body: dict[str, Any], fields: dict[str, FieldRule]) -> None:
    """Refuse every field that is unknown, or known but not supported with its value.

    Raises:
        APIError: 400 naming the field.
    """
    for name, value in body.items():
        rule = fields.get(name)
        if rule is None:
            raise APIError(
                400, f"unknown field {name!r}: this server does not support it", param=name
            )
        if isinstance(rule, _Only) and not rule(value, body):
            raise APIError(
                400, f"{name}={json.dumps(value)[:80]} is not supported by this server", param=name
            )


def _field(body: dict[str, Any], name: str, kinds: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    allowed = kinds if isinstance(kinds, tuple) else (kinds,)
    if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, kinds):
        raise APIError(400, f"{name} has the wrong type: {value!r}", param=name)
    return value


@dataclass(frozen=True)
class StreamOptions:
    """``stream_options``: a final chunk with usage, and usage on every chunk (vLLM)."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


def stream_options(body: dict[str, Any]) -> StreamOptions:
    """Parse ``stream_options`` (allowed only with ``stream: true``, as OpenAI does).

    Raises:
        APIError: 400 for a value of the wrong type or an unknown option.
    """
    raw = body.get("stream_options")
    if raw is None:
        return StreamOptions()
    if not isinstance(raw, dict):
        raise APIError(
            400, f"stream_options must be an object, got {raw!r}", param="stream_options"
        )
    if not body.get("stream"):
        raise APIError(400, "stream_options needs stream: true", param="stream_options")
    known = {"include_usage", "continuous_usage_stats", "include_obfuscation"}
    for key, value in raw.items():
        if key not in known:
            raise APIError(400, f"unknown stream option {key!r}", param=f"stream_options.{key}")
        if value is not None and not isinstance(value, bool):
            raise APIError(
                400, f"stream_options.{key} must be a boolean", param=f"stream_options.{key}"
            )
    return StreamOptions(bool(raw.get("include_usage")), bool(raw.get("continuous_usage_stats")))


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    if not chat:
        return _field(body, "logprobs", int, None)
    want = _field(body, "logprobs", bool, False)
    top = _field(body, "top_logprobs", int, None)
    if top is not None and not want:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if want else None


def _top_k(body: dict[str, Any]) -> int | None:
    k = _field(body, "top_k", int, None)
    return None if k in (None, -1, 0) else k  # vLLM: -1 (and 0) turn top-k off


def sampling_params(body: dict[str, Any], *, chat: bool, grammar: Any = None) -> SamplingParams:
    """The request's sampling parameters.

    Raises:
        APIError: 400 naming the field for a value of the wrong type or out of range.
    """
    max_tokens = _field(body, "max_tokens", int, None)
    if chat:
        max_tokens = _field(body, "max_completion_tokens", int, max_tokens)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str | list):
        raise APIError(
            400, f"stop must be a string or a list of strings, got {stop!r}", param="stop"
        )
    try:
        return SamplingParams(
            max_tokens=16 if max_tokens is None else max_tokens,  # OpenAI's completions default
            temperature=_field(body, "temperature", (int, float), 1.0),
            top_p=_field(body, "top_p", (int, float), 1.0),
            top_k=_top_k(body),
            min_p=_field(body, "min_p", (int, float), 0.0),
            presence_penalty=_field(body, "presence_penalty", (int, float), 0.0),
            frequency_penalty=_field(body, "frequency_penalty", (int, float), 0.0),
            repetition_penalty=_field(body, "repetition_penalty", (int, float), 1.0),
            logit_bias=_field(body, "logit_bias", dict, {}),
            seed=_field(body, "seed", int, None),
            stop=tuple([stop] if isinstance(stop, str) else (stop or [])),
            stop_token_ids=tuple(_field(body, "stop_token_ids", list, [])),
            include_stop_str_in_output=_field(body, "include_stop_str_in_output", bool, False),
            n=_field(body, "n", int, 1),
            logprobs=_logprobs(body, chat),
            ignore_eos=_field(body, "ignore_eos", bool, False),
            min_tokens=_field(body, "min_tokens", int, 0),
            skip_special_tokens=_field(body, "skip_special_tokens", bool, True),
            grammar=grammar,
        )
    except ParamError as e:
        raise APIError(400, str(e), param=e.param) from None


_ROLES = {"system", "developer", "user", "assistant", "tool"}


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or text parts joined by newlines (vLLM's rule)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of parts", param=where)
    texts: list[str] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise APIError(
                400,
                f"{where}.content[{j}]: content parts of type {kind!r} are not supported "
                "(this server reads text parts only)",
                param=f"{where}.content",
            )
    return "\n".join(texts)


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, arguments parsed for the chat template."""
    if not isinstance(calls, list):
        raise APIError(400, f"{where}.tool_calls must be a list", param=where)
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(400, f"{where}.tool_calls: each needs function.name", param=where)
        args = fn.get("arguments", "{}")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            parsed = args
        out.append(call | {"function": {"name": fn["name"], "arguments": parsed}})
    return out


def chat_messages(raw: Any) -> list[dict[str, Any]]:
    """Messages as a chat template reads them.

    ``content`` may be a string, a list of text parts (joined by newlines), or null on an
    assistant message; ``name`` is passed on; ``developer`` becomes ``system`` (the role
    OpenAI's developer messages replace); ``tool`` messages keep ``tool_call_id``.

    Raises:
        APIError: 400 naming the message and what is wrong (a non-text part, a bad role).
    """
    if not isinstance(raw, list) or not raw:
        raise APIError(400, "messages must be a non-empty list", param="messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            role = m.get("role") if isinstance(m, dict) else m
            raise APIError(
                400, f"{where}: role must be one of {sorted(_ROLES)}, got {role!r}", param=where
            )
        role = "system" if m["role"] == "developer" else m["role"]
        content = m.get("content")
        if content is None and not (role == "assistant"):
            raise APIError(400, f"{where}.content is missing", param=where)
        msg: dict[str, Any] = {
            "role": role,
            "content": "" if content is None else _text(content, where),
        }
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], where)
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise APIError(400, f"{where}: a tool message needs tool_call_id", param=where)
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out
