"""Serving: a continuous-batching engine over the paged KV cache, and an OpenAI-compatible API.

:class:`Engine` schedules requests step by step; :class:`AsyncEngine` runs it in a
thread for an asyncio server; :mod:`attnlab.serving.openai_api` builds the HTTP app
(the ``serve`` extra: FastAPI and uvicorn).
"""

from attnlab.serving.async_engine import AsyncEngine
from attnlab.serving.engine import Engine, QueueFull
from attnlab.serving.outputs import CompletionDelta, RequestOutput
from attnlab.serving.params import ParamError, SamplingParams
from attnlab.serving.server import BackgroundServer, load_engine

__all__ = [
    "AsyncEngine",
    "BackgroundServer",
    "CompletionDelta",
    "Engine",
    "ParamError",
    "QueueFull",
    "RequestOutput",
    "SamplingParams",
    "load_engine",
]
