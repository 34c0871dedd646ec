"""The chat handler: messages rendered by the chat template, structured outputs and tool
calls (:mod:`attnlab.serving.structured`), responses whole or streamed."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from attnlab.serving.handlers import Routes, bool_field, sse, stream_flag, usage
from attnlab.serving.params import SamplingParams
from attnlab.serving.protocol import (
    CHAT_FIELDS,
    APIError,
    StreamOptions,
    chat_messages,
    sampling_params,
    stream_options,
)
from attnlab.serving.structured import OutputPlan, ToolStream, parse_tool_calls

__all__ = ["ChatRoutes"]


class ChatRoutes(Routes):
    """The completions handler and the chat handler."""

    def render(self, body: dict[str, Any], plan: OutputPlan) -> list[int]:
        messages = chat_messages(body.get("messages"))
        add = bool_field(body, "add_generation_prompt", True)
        cont = bool_field(body, "continue_final_message", False)
        if add and cont:
            raise APIError(
                400,
                "continue_final_message needs add_generation_prompt: false",
                param="continue_final_message",
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=plan.tools,
                add_generation_prompt=add,
                continue_final_message=cont,
                tokenize=False,
            )
        except Exception as e:  # the template refused the conversation (jinja's message)
            raise APIError(
                400, f"the chat template cannot render these messages: {e}", param="messages"
            ) from None
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def chat(self, request: Any) -> Any:
        from fastapi.responses import JSONResponse, StreamingResponse

        body = await self.body(request, CHAT_FIELDS)
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, f"model {self.model_name!r} has no chat template", param="messages")
        plan = await self.plan(body, chat=True)
        ids = self.render(body, plan)
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body = body | {
                "max_tokens": self.default_chat_max_tokens
                or max(1, self.engine.max_model_len - len(ids))
            }
        params = sampling_params(body, chat=True, grammar=plan.grammar)
        opts = stream_options(body)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        self.admit([ids], params)
        if stream_flag(body):
            return StreamingResponse(
                self.chat_events(ids, params, rid, opts, plan), media_type="text/event-stream"
            )
        acc = await self.collect(request, [ids], params, rid)
        choices = []
        for (_, j), d in sorted(acc.items()):
            content, calls = parse_tool_calls(d.text, plan)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            reason = d.finish_reason
            if calls:
                message["tool_calls"] = calls
                reason = "tool_calls" if reason == "stop" else reason
            choices.append(
                {
                    "index": j,
                    "message": message,
                    "logprobs": (
                        self.chat_logprobs(d.logprobs) if params.logprobs is not None else None
                    ),
                    "finish_reason": reason,
                }
            )
        totals = usage(len(ids), sum(len(d.token_ids) for d in acc.values()))
        return JSONResponse(
            self.base(rid, "chat.completion") | {"choices": choices, "usage": totals}
        )

    async def chat_events(
        self,
        ids: list[int],
        params: SamplingParams,
        rid: str,
        opts: StreamOptions,
        plan: OutputPlan,
    ) -> AsyncIterator[str]:
        base = self.base(rid, "chat.completion.chunk")
        generated = 0
        tools: dict[int, ToolStream] = {}

        def chunk(index: int, delta: dict[str, Any], reason: str | None, lp: Any) -> str:
            out = base | {
                "choices": [
                    {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
                ]
            }
            if opts.continuous_usage_stats:
                out["usage"] = usage(len(ids), generated)
            return sse(out)

        try:
            async for _, out in self.outputs([ids], params, rid):
                for d in out.outputs:
                    generated += len(d.token_ids)
                    first = d.index not in tools
                    ts = tools.setdefault(d.index, ToolStream(plan))
                    deltas = ts.feed(d.text)
                    if d.finish_reason is not None:
                        deltas += ts.finish()
                    if first:
                        deltas = [
                            {"role": "assistant", **(deltas[0] if deltas else {"content": ""})},
                            *deltas[1:],
                        ]
                    lp = self.chat_logprobs(d.logprobs) if params.logprobs is not None else None
                    if not deltas and lp is not None:
                        deltas = [{}]
                    for k, delta in enumerate(deltas):
                        yield chunk(d.index, delta, None, lp if k == 0 else None)
                    if d.finish_reason is not None:
                        reason = d.finish_reason
                        if ts.made_calls and reason == "stop":
                            reason = "tool_calls"
                        yield chunk(d.index, {}, reason, None)
        except APIError as e:
            yield sse(e.body())
        totals = usage(len(ids), generated)
        if opts.include_usage:
            yield sse(base | {"choices": [], "usage": totals})
        yield "data: [DONE]\n\n"
