"""Chat data for supervised fine-tuning: JSONL rows rendered by the model's chat template.

A row is ``{"messages": [{"role": ..., "content": ...}, ...]}`` (any number of turns) or
``{"prompt": ..., "completion": ...}`` (one user turn and one assistant turn). The
tokenizer's chat template renders the conversation; the loss counts the assistant's tokens
only. Which characters are the assistant's comes from the template itself: the text of
assistant turn ``i`` is what rendering ``messages[: i + 1]`` adds to rendering
``messages[:i]`` with the generation prompt (``<|im_start|>assistant\\n`` in ChatML), so
the span holds the reply and the template's end of turn (the model learns to stop), and
never the role header. A template whose renderings are not prefixes of each other (one
that rewrites earlier turns) is refused, not guessed at. Tokens are then marked from
their character offsets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ChatExample", "encode_chat", "read_chat_jsonl"]

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class ChatExample:
    """One rendered conversation.

    Attributes:
        input_ids: the template's tokens.
        assistant: per token, whether it is the assistant's (a target of the loss).
    """

    input_ids: list[int]
    assistant: list[bool]

    def __len__(self) -> int:
        return len(self.input_ids)


def _messages(row: Any, where: str) -> Messages:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ValueError(f"{where}: 'messages' must be a non-empty list, got {msgs!r:.80}")
        for j, m in enumerate(msgs):
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise ValueError(
                    f"{where}: messages[{j}] must be {{'role': str, 'content': str}}, got {m!r:.80}"
                )
        if not any(m["role"] == "assistant" for m in msgs):
            raise ValueError(f"{where}: no assistant message, so nothing to learn")
        return [{"role": m["role"], "content": m["content"]} for m in msgs]
    if "prompt" in row and "completion" in row:
        p, c = row["prompt"], row["completion"]
        if not isinstance(p, str) or not isinstance(c, str):
            raise ValueError(f"{where}: 'prompt' and 'completion' must be strings")
        return [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
    raise ValueError(
        f"{where}: expected {{'messages': [...]}} or {{'prompt', 'completion'}}, got keys "
        f"{sorted(row)}"
    )


def read_chat_jsonl(path: str | Path) -> list[Messages]:
    """The conversations of a JSONL file, one per non-empty line.

    Raises:
        ValueError: a missing file, a line that is not JSON, or a row of another shape
            (the message names the line).
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"chat data {str(p)!r} does not exist (expected a .jsonl file)")
    out: list[Messages] = []
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{n}: not valid JSON ({e.msg})") from None
            out.append(_messages(row, f"{p}:{n}"))
    if not out:
        raise ValueError(f"chat data {str(p)!r} holds no rows")
    return out


def _render(tokenizer: Any, messages: Messages, *, prompt: bool) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
    return str(text)


def assistant_spans(tokenizer: Any, messages: Messages) -> tuple[str, list[tuple[int, int]]]:
    """``(text, [(start, end) character spans of the assistant's turns])``.

    Raises:
        ValueError: the tokenizer has no chat template, or the template is not
            incremental (a shorter conversation does not render to a prefix).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the tokenizer has no chat template, so chat rows cannot be rendered (use a "
            "model whose tokenizer_config.json carries one)"
        )
    text = _render(tokenizer, messages, prompt=False)
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], prompt=True) if i else ""
        upto = _render(tokenizer, messages[: i + 1], prompt=False)
        if not upto.startswith(before) or not text.startswith(upto):
            raise ValueError(
                "the chat template does not render conversations incrementally (turn "
                f"{i} changes the text before it), so the assistant's tokens cannot be "
                "told apart"
            )
        spans.append((len(before), len(upto)))
    return text, spans


def encode_chat(tokenizer: Any, messages: Messages) -> ChatExample:
    """Tokens of the rendered conversation and which of them are the assistant's.

    A token belongs to the assistant when its first character lies in an assistant span.
    """
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    marks = [any(a <= s < b for a, b in spans) and e > s for s, e in enc["offset_mapping"]]
    return ChatExample(input_ids=ids, assistant=marks)
