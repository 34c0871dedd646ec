"""The request handlers of the OpenAI-compatible API: reading a request, running it on the
engine, and writing its response (whole, or as server-sent events). The completions
handler is here; :mod:`attnlab.serving.chat_handlers` adds chat on top.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from attnlab.serving.access_log import record_timings, record_usage
from attnlab.serving.async_engine import AsyncEngine
from attnlab.serving.engine import QueueFull
from attnlab.serving.engine_client import EngineProcess
from attnlab.serving.outputs import CompletionDelta, RequestOutput, TokenLogprob
from attnlab.serving.params import ParamError, SamplingParams
from attnlab.serving.protocol import (
    COMPLETION_FIELDS,
    APIError,
    StreamOptions,
    check_fields,
    check_text,
    sampling_params,
    stream_options,
)
from attnlab.serving.structured import OutputPlan, output_plan

__all__ = ["Routes", "bool_field", "sse", "stream_flag", "usage"]


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def usage(prompt_tokens: int, generated: int) -> dict[str, int]:
    totals = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": prompt_tokens + generated,
    }
    record_usage(totals)  # for the request's access-log line
    return totals


def stream_flag(body: dict[str, Any]) -> bool:
    value = body.get("stream")
    if value is not None and not isinstance(value, bool):
        raise APIError(400, f"stream must be a boolean, got {value!r}", param="stream")
    return bool(value)


def bool_field(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"{name} must be a boolean, got {value!r}", param=name)
    return value


class Routes:
    """The handlers' shared state and steps (one instance per app)."""

    def __init__(
        self,
        engine: AsyncEngine | EngineProcess,
        model_name: str,
        default_chat_max_tokens: int | None,
    ) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.default_chat_max_tokens = default_chat_max_tokens

    # ------------------------------------------------------------------ requests

    async def body(self, request: Any, fields: dict[str, Any]) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise APIError(400, "the request body is nested too deeply") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        check_text(body)
        if body.get("model") != self.model_name:
            raise APIError(
                404,
                f"unknown model {body.get('model')!r}; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        check_fields(body, fields)
        return body

    def prompts(self, body: dict[str, Any]) -> list[list[int]]:
        prompt = body.get("prompt")
        items: list[Any]
        if isinstance(prompt, str) or (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
        ):
            items = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
            items = prompt
        else:
            raise APIError(
                400, "prompt must be a string, a list of strings, or token ids", param="prompt"
            )
        out: list[list[int]] = []
        for p in items:
            if isinstance(p, str):
                out.append(list(self.tokenizer.encode(p)))
            elif all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                out.append(list(p))
            else:
                raise APIError(400, "token-id prompts must be lists of integers", param="prompt")
        return out

    async def plan(self, body: dict[str, Any], *, chat: bool) -> OutputPlan:
        if body.get("response_format") is None and not (chat and body.get("tools") is not None):
            if chat and body.get("tool_choice") not in (None, "none"):
                raise APIError(400, "tool_choice needs tools", param="tool_choice")
            return OutputPlan()
        return await asyncio.to_thread(
            output_plan, body, self.tokenizer, self.engine.vocab_size, chat=chat
        )

    def admit(self, prompts: list[list[int]], params: SamplingParams) -> None:
        for ids in prompts:
            try:
                self.engine.validate(ids, params)
            except ParamError as e:
                raise APIError(400, str(e), param=e.param) from None
        try:
            self.engine.check_capacity()
        except QueueFull as e:
            raise APIError(429, str(e), code="queue_full") from None
        if not self.engine.alive:
            raise APIError(503, "the engine has stopped", code="engine_stopped")

    async def outputs(
        self, prompts: list[list[int]], params: SamplingParams, rid: str
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Merged outputs of each prompt's request; aborts all when abandoned."""
        merged: asyncio.Queue[Any] = asyncio.Queue()
        streams = [self.engine.generate(f"{rid}-{i}", ids, params) for i, ids in enumerate(prompts)]

        async def pump(i: int, it: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in it:
                    await merged.put((i, out))
            except BaseException as e:
                await merged.put(e)
                raise
            finally:
                await merged.put((i, None))

        tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(streams)]
        live = len(tasks)
        try:
            while live:
                item = await merged.get()
                if isinstance(item, QueueFull):
                    raise APIError(429, str(item), code="queue_full")
                if isinstance(item, ParamError):
                    raise APIError(400, str(item), param=item.param)
                if isinstance(item, BaseException):
                    raise APIError(503, f"the engine failed: {item}", code="engine_stopped")
                i, out = item
                if out is None:
                    live -= 1
                    continue
                if out.error is not None:
                    raise APIError(500, f"the request failed: {out.error}", code="request_failed")
                if out.timings is not None:
                    record_timings(out.timings)
                yield i, out
        finally:
            for t in tasks:
                t.cancel()  # an unfinished request is aborted in its stream's cleanup
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(
        self, request: Any, prompts: list[list[int]], params: SamplingParams, rid: str
    ) -> dict[tuple[int, int], CompletionDelta]:
        acc: dict[tuple[int, int], CompletionDelta] = {}

        async def consume() -> None:
            async for i, out in self.outputs(prompts, params, rid):
                for d in out.outputs:
                    have = acc.setdefault((i, d.index), CompletionDelta(index=d.index))
                    have.text += d.text
                    have.token_ids += d.token_ids
                    have.logprobs += d.logprobs
                    have.finish_reason = d.finish_reason or have.finish_reason

        task = asyncio.create_task(consume())
        while not task.done():
            await asyncio.wait([task], timeout=0.25)
            if not task.done() and await request.is_disconnected():
                task.cancel()  # the client left: abort its requests, free their blocks
                raise APIError(499, "client disconnected")
        task.result()
        return acc

    # ------------------------------------------------------------------ formatting

    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    def completion_logprobs(self, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
        tokens = [self.token_text(lp.token_id) for lp in lps]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self.token_text(t): v for t, v in lp.top} for lp in lps],
            "text_offset": offsets,
        }

    def chat_logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any]:
        def entry(t: int, v: float) -> dict[str, Any]:
            s = self.token_text(t)
            return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

        return {
            "content": [
                entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
                for lp in lps
            ]
        }

    def base(self, rid: str, kind: str) -> dict[str, Any]:
        return {"id": rid, "object": kind, "created": int(time.time()), "model": self.model_name}

    # ------------------------------------------------------------------ completions

    async def completions(self, request: Any) -> Any:
        from fastapi.responses import JSONResponse, StreamingResponse

        body = await self.body(request, COMPLETION_FIELDS)
        plan = await self.plan(body, chat=False)
        params = sampling_params(body, chat=False, grammar=plan.grammar)
        prompts = self.prompts(body)
        opts = stream_options(body)
        rid = f"cmpl-{uuid.uuid4().hex}"
        self.admit(prompts, params)
        if not stream_flag(body):
            acc = await self.collect(request, prompts, params, rid)
            choices = [
                {
                    "index": i * params.n + j,
                    "text": d.text,
                    "logprobs": (
                        self.completion_logprobs(d.logprobs, 0)
                        if params.logprobs is not None
                        else None
                    ),
                    "finish_reason": d.finish_reason,
                }
                for (i, j), d in sorted(acc.items())
            ]
            generated = sum(len(d.token_ids) for d in acc.values())
            totals = usage(sum(map(len, prompts)), generated)
            return JSONResponse(
                self.base(rid, "text_completion") | {"choices": choices, "usage": totals}
            )
        return StreamingResponse(
            self.completion_events(prompts, params, rid, opts), media_type="text/event-stream"
        )

    async def completion_events(
        self, prompts: list[list[int]], params: SamplingParams, rid: str, opts: StreamOptions
    ) -> AsyncIterator[str]:
        base = self.base(rid, "text_completion")
        prompt_tokens = sum(map(len, prompts))
        generated = 0
        offsets: dict[tuple[int, int], int] = {}
        try:
            async for i, out in self.outputs(prompts, params, rid):
                for d in out.outputs:
                    generated += len(d.token_ids)
                    key = (i, d.index)
                    lp = None
                    if params.logprobs is not None:
                        lp = self.completion_logprobs(d.logprobs, offsets.get(key, 0))
                    offsets[key] = offsets.get(key, 0) + len(d.text)
                    choice = {
                        "index": i * params.n + d.index,
                        "text": d.text,
                        "logprobs": lp,
                        "finish_reason": d.finish_reason,
                    }
                    chunk = base | {"choices": [choice]}
                    if opts.continuous_usage_stats:
                        chunk["usage"] = usage(prompt_tokens, generated)
                    yield sse(chunk)
        except APIError as e:
            yield sse(e.body())
        totals = usage(prompt_tokens, generated)
        if opts.include_usage:
            yield sse(base | {"choices": [], "usage": totals})
        yield "data: [DONE]\n\n"
