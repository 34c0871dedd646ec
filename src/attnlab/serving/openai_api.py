"""An OpenAI-compatible HTTP API over the engine (FastAPI; the ``serve`` extra).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (when the tokenizer
has a chat template), both with ``stream: true`` as server-sent events; ``GET
/v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text). Errors are OpenAI
error objects ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad
request (naming the field), 401 for a wrong API key, 429 when the queue is full, 503
when the engine has stopped. A client that disconnects aborts its request, which
frees its KV blocks.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations at run
# time, and `Request` is imported inside build_app (FastAPI is an optional extra).

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from attnlab.serving.async_engine import AsyncEngine
from attnlab.serving.engine import CompletionDelta, QueueFull, RequestOutput, TokenLogprob
from attnlab.serving.params import ParamError, SamplingParams

__all__ = ["build_app"]


class APIError(Exception):
    """An error answered as an OpenAI error object."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = {
            400: "invalid_request_error",
            401: "authentication_error",
            404: "invalid_request_error",
            429: "rate_limit_error",
        }.get(self.status, "server_error")
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


def _field(body: dict[str, Any], name: str, kinds: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise APIError(400, f"{name} has the wrong type: {value!r}", param=name)
    if not isinstance(value, kinds):
        raise APIError(400, f"{name} has the wrong type: {value!r}", param=name)
    return value


def _unpaired_surrogate(body: Any) -> str | None:
    """The path (``messages[0].content``) of the first string in ``body`` holding a lone
    UTF-16 surrogate (``"\\ud800"``, which JSON can escape but UTF-8 cannot encode), or None.
    Iterative: a parsed body can be nested as deep as the parser allows."""
    todo: list[tuple[str, Any]] = [("", body)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(value, dict):
            for k, v in value.items():
                todo.append((f"{path}.{k}" if path else str(k), v))
                if isinstance(k, str) and _unpaired_surrogate(k) is not None:
                    return path or "body"
        elif isinstance(value, list):
            todo.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
    return None


def _stream_options(body: dict[str, Any]) -> bool:
    """``stream_options.include_usage``: an object with a boolean, or absent."""
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise APIError(
            400,
            f'stream_options must be an object such as {{"include_usage": true}}, got {opts!r}',
            param="stream_options",
        )
    usage = opts.get("include_usage", False)
    if not isinstance(usage, bool):
        raise APIError(
            400,
            f"stream_options.include_usage must be true or false, got {usage!r}",
            param="stream_options.include_usage",
        )
    return usage


def _sampling(body: dict[str, Any], *, chat: bool) -> SamplingParams:
    max_tokens = _field(body, "max_tokens", int, None)
    if chat:
        max_tokens = _field(body, "max_completion_tokens", int, max_tokens)
    if max_tokens is None:
        max_tokens = 16  # OpenAI's default for completions
    logprobs: int | None
    if chat:
        want = _field(body, "logprobs", bool, False)
        top = _field(body, "top_logprobs", int, 0)
        if top and not want:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = top if want else None
    else:
        logprobs = _field(body, "logprobs", int, None)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str | list):
        raise APIError(
            400, f"stop must be a string or a list of strings, got {stop!r}", param="stop"
        )
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_field(body, "temperature", (int, float), 1.0),
            top_p=_field(body, "top_p", (int, float), 1.0),
            top_k=_field(body, "top_k", int, None),
            seed=_field(body, "seed", int, None),
            stop=tuple([stop] if isinstance(stop, str) else (stop or [])),
            n=_field(body, "n", int, 1),
            logprobs=logprobs,
            ignore_eos=_field(body, "ignore_eos", bool, False),
        )
    except ParamError as e:
        raise APIError(400, str(e), param=e.param) from None


class _BearerAuth:
    """``Authorization: Bearer KEY`` on ``/v1/``, as plain ASGI middleware.

    Not ``@app.middleware("http")``: Starlette's ``BaseHTTPMiddleware`` wraps ``receive``,
    and behind it ``request.is_disconnected()`` never saw a client leave, so a
    non-streaming request whose client hung up generated all its tokens.
    """

    def __init__(self, app: Any, *, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode("latin-1")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if given != self.expected:
                from fastapi.responses import JSONResponse

                err = APIError(401, "invalid API key", code="invalid_api_key")
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _token_text(tokenizer: Any, token_id: int) -> str:
    return str(tokenizer.decode([token_id]))


def build_app(
    engine: AsyncEngine,
    *,
    model_name: str,
    api_key: str | None = None,
    default_chat_max_tokens: int | None = None,
) -> Any:
    """The FastAPI application serving ``engine`` under the name ``model_name``.

    Args:
        engine: the engine (its thread is started and stopped with the app).
        model_name: the model id clients pass as ``model``.
        api_key: when set, ``Authorization: Bearer <api_key>`` is required on ``/v1/``.
        default_chat_max_tokens: ``max_tokens`` of a chat request that gives none
            (default: the rest of the context).

    Raises:
        ImportError: FastAPI is missing (install the ``serve`` extra).
    """
    try:
        from contextlib import asynccontextmanager

        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "attnlab serve needs FastAPI and uvicorn: pip install 'attnlab[serve]'"
        ) from e

    eng = engine.engine
    tokenizer = eng.tokenizer
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="attnlab", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status)

    if api_key is not None:
        app.add_middleware(_BearerAuth, api_key=api_key)

    @app.get("/health")
    async def health() -> Response:
        if not engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "attnlab"}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Response:
        a = eng.pool.allocator
        text = eng.metrics.prometheus(
            cache_hit_rate=a.hits / a.queries if a.queries else 0.0,
            blocks_free=eng.pool.num_free_blocks,
            live=eng.gauges(),
        )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def _body(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise APIError(400, "the request body is nested too deeply to parse") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        bad = _unpaired_surrogate(body)
        if bad is not None:
            raise APIError(
                400,
                f"{bad} holds an unpaired UTF-16 surrogate (such as \\ud800): not text",
                param=bad,
            )
        model = body.get("model")
        if model != model_name:
            raise APIError(
                400,
                f"unknown model {model!r}; this server serves {model_name!r}",
                param="model",
                code="model_not_found",
            )
        return body

    def _prompts(body: dict[str, Any]) -> list[list[int]]:
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
                out.append(list(tokenizer.encode(p)))
            elif all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                out.append(list(p))
            else:
                raise APIError(400, "token-id prompts must be lists of integers", param="prompt")
        return out

    def _admit() -> None:
        try:
            engine.check_capacity()
        except QueueFull as e:
            raise APIError(429, str(e), code="queue_full") from None
        if not engine.alive:
            raise APIError(503, "the engine has stopped", code="engine_stopped")

    def _check(ids: list[int], params: SamplingParams) -> None:
        try:
            eng.validate(ids, params)
        except ParamError as e:
            raise APIError(400, str(e), param=e.param) from None

    async def _outputs(
        request: Request, prompts: list[list[int]], params: SamplingParams, rid: str
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Merged outputs of each prompt's request; aborts all when abandoned."""
        merged: asyncio.Queue[Any] = asyncio.Queue()
        streams = [engine.generate(f"{rid}-{i}", ids, params) for i, ids in enumerate(prompts)]

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
                    raise APIError(503, f"the engine failed: {item}")
                i, out = item
                if out is None:
                    live -= 1
                    continue
                yield i, out
        finally:
            for t in tasks:
                t.cancel()  # an unfinished request is aborted in its stream's cleanup
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _collect(
        request: Request, prompts: list[list[int]], params: SamplingParams, rid: str
    ) -> dict[tuple[int, int], CompletionDelta]:
        acc: dict[tuple[int, int], CompletionDelta] = {}

        async def consume() -> None:
            async for i, out in _outputs(request, prompts, params, rid):
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

    def _completion_logprobs(lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
        tokens = [_token_text(tokenizer, lp.token_id) for lp in lps]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{_token_text(tokenizer, t): v for t, v in lp.top} for lp in lps],
            "text_offset": offsets,
        }

    def _chat_logprobs(lps: list[TokenLogprob]) -> dict[str, Any]:
        def entry(t: int, v: float) -> dict[str, Any]:
            s = _token_text(tokenizer, t)
            return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

        return {
            "content": [
                entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
                for lp in lps
            ]
        }

    def _usage(prompts: list[list[int]], generated: int) -> dict[str, int]:
        p = sum(len(x) for x in prompts)
        return {"prompt_tokens": p, "completion_tokens": generated, "total_tokens": p + generated}

    def _sse(obj: Any) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _body(request)
        if body.get("echo"):
            raise APIError(400, "echo is not supported", param="echo")
        params = _sampling(body, chat=False)
        prompts = _prompts(body)
        for ids in prompts:
            _check(ids, params)
        rid = f"cmpl-{uuid.uuid4().hex}"
        n = params.n
        stream = _field(body, "stream", bool, False)
        usage_opt = _stream_options(body)
        base = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
        }
        _admit()
        if not stream:
            acc = await _collect(request, prompts, params, rid)
            choices = []
            for (i, j), d in sorted(acc.items()):
                lp = _completion_logprobs(d.logprobs, 0) if params.logprobs is not None else None
                choices.append(
                    {
                        "index": i * n + j,
                        "text": d.text,
                        "logprobs": lp,
                        "finish_reason": d.finish_reason,
                    }
                )
            generated = sum(len(d.token_ids) for d in acc.values())
            return JSONResponse(base | {"choices": choices, "usage": _usage(prompts, generated)})

        async def events() -> AsyncIterator[str]:
            generated = 0
            offsets: dict[tuple[int, int], int] = {}
            try:
                async for i, out in _outputs(request, prompts, params, rid):
                    for d in out.outputs:
                        generated += len(d.token_ids)
                        key = (i, d.index)
                        lp = None
                        if params.logprobs is not None:
                            lp = _completion_logprobs(d.logprobs, offsets.get(key, 0))
                        offsets[key] = offsets.get(key, 0) + len(d.text)
                        choice = {
                            "index": i * n + d.index,
                            "text": d.text,
                            "logprobs": lp,
                            "finish_reason": d.finish_reason,
                        }
                        yield _sse(base | {"choices": [choice]})
            except APIError as e:
                yield _sse(e.body())
            if usage_opt:
                yield _sse(base | {"choices": [], "usage": _usage(prompts, generated)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await _body(request)
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, f"model {model_name!r} has no chat template", param="messages")
        messages = body.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
                for m in messages
            )
        ):
            raise APIError(
                400,
                "messages must be a non-empty list of {role, content} strings",
                param="messages",
            )
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body = dict(body)
            body["max_tokens"] = default_chat_max_tokens
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = max(1, eng.max_model_len - len(ids))
        params = _sampling(body, chat=True)
        _check(ids, params)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stream = _field(body, "stream", bool, False)
        usage_opt = _stream_options(body)
        base = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
        }
        _admit()
        if not stream:
            acc = await _collect(request, [ids], params, rid)
            choices = [
                {
                    "index": j,
                    "message": {"role": "assistant", "content": d.text},
                    "logprobs": _chat_logprobs(d.logprobs) if params.logprobs is not None else None,
                    "finish_reason": d.finish_reason,
                }
                for (_, j), d in sorted(acc.items())
            ]
            generated = sum(len(d.token_ids) for d in acc.values())
            return JSONResponse(base | {"choices": choices, "usage": _usage([ids], generated)})
        base["object"] = "chat.completion.chunk"

        async def events() -> AsyncIterator[str]:
            generated = 0
            started: set[int] = set()
            try:
                async for _, out in _outputs(request, [ids], params, rid):
                    for d in out.outputs:
                        generated += len(d.token_ids)
                        delta: dict[str, Any] = {"content": d.text}
                        if d.index not in started:
                            started.add(d.index)
                            delta = {"role": "assistant"} | delta
                        lp = _chat_logprobs(d.logprobs) if params.logprobs is not None else None
                        choice = {
                            "index": d.index,
                            "delta": delta,
                            "logprobs": lp,
                            "finish_reason": d.finish_reason,
                        }
                        yield _sse(base | {"choices": [choice]})
            except APIError as e:
                yield _sse(e.body())
            if usage_opt:
                yield _sse(base | {"choices": [], "usage": _usage([ids], generated)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app
