"""Run the OpenAI-compatible app with uvicorn, in the foreground or in a thread (tests, benchmarks)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, TextIO

from attnlab.serving.access_log import AccessLog
from attnlab.serving.async_engine import AsyncEngine
from attnlab.serving.engine import Engine
from attnlab.serving.engine_client import EngineProcess
from attnlab.serving.openai_api import build_app

__all__ = ["BackgroundServer", "load_engine"]


def load_engine(
    model: str | Path | None = None,
    *,
    chat_template: str | Path | None = None,
    progress: bool = False,
    **engine_kwargs: Any,
) -> tuple[Engine, str]:
    """``(engine, model name)`` for a model folder (config, safetensors, tokenizer) or a
    ``.gguf`` file; None serves SmolLM2-135M-Instruct (model id ``SmolLM2-135M-Instruct``).

    Args:
        model: the folder or file, or None.
        chat_template: a Jinja chat template file (or ``"chatml"``) for a tokenizer without one.
        progress: a progress bar while a GGUF file loads.
        engine_kwargs: :class:`~attnlab.serving.engine.Engine`'s settings.

    Raises:
        ModelFileError: the folder or file is missing or damaged, or has no tokenizer
            (what is missing and how to add it).
        ValueError: an architecture attnlab cannot serve (an encoder, an encoder-decoder).
    """
    from attnlab.errors import ModelFileError
    from attnlab.interop.causal_lm import load_causal_lm

    lm = load_causal_lm(model, chat_template=chat_template, progress=progress)
    if lm.tokenizer is None:
        raise ModelFileError(
            f"{lm.source} has no tokenizer files (tokenizer.json): a server reads and writes "
            "text; train on text (attnlab train --preset stdlib-bpe) or copy the tokenizer "
            "files of the model's training run into the folder"
        )
    return Engine(lm.model, lm.tokenizer, **engine_kwargs), lm.name


class BackgroundServer:
    """uvicorn serving an engine on ``127.0.0.1`` in a daemon thread, stopped by :meth:`stop`
    or after ``max_seconds`` (so a test or benchmark can never leave it running).

    Args:
        engine: the engine (run in a thread of this process), or an
            :class:`~attnlab.serving.engine_client.EngineProcess` (the engine in its own
            process, as ``attnlab serve`` runs it), or None (embeddings only).
        model_name: the model id of the API.
        port: 0 picks a free port (read :attr:`port` after :meth:`start`).
        api_key: see :func:`~attnlab.serving.openai_api.build_app`.
        max_seconds: the server stops itself after this long.
        access_log: a stream for one line per request (as ``attnlab serve`` logs them).
        embeddings: an :class:`~attnlab.serving.embeddings.EmbeddingService` to serve
            ``/v1/embeddings`` beside the engine (or alone, with ``engine=None``).
    """

    def __init__(
        self,
        engine: Engine | EngineProcess | None,
        *,
        model_name: str = "attnlab",
        port: int = 0,
        api_key: str | None = None,
        max_seconds: float = 600.0,
        access_log: TextIO | None = None,
        embeddings: Any = None,
    ) -> None:
        import uvicorn

        self.async_engine: Any = (
            engine if isinstance(engine, EngineProcess) or engine is None else AsyncEngine(engine)
        )
        app: Any = build_app(
            self.async_engine, model_name=model_name, api_key=api_key, embeddings=embeddings
        )
        if access_log is not None:
            app = AccessLog(app, stream=access_log)
        # a long keep-alive: a client must not reuse a connection the server is closing
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan="on",
            timeout_keep_alive=75,
        )
        self.server = uvicorn.Server(config)
        self.max_seconds = max_seconds
        self._thread: threading.Thread | None = None
        self._timer: threading.Timer | None = None
        self.port = port

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        """Start serving; returns when the socket listens."""
        self._thread = threading.Thread(target=self.server.run, name="attnlab-http", daemon=True)
        self._thread.start()
        self._timer = threading.Timer(self.max_seconds, self.stop)
        self._timer.daemon = True
        self._timer.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        sockets = [s for srv in self.server.servers for s in srv.sockets]
        self.port = sockets[0].getsockname()[1]
        return self

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def stop(self) -> None:
        """Stop serving and the engine thread."""
        self.server.should_exit = True
        if self._timer is not None:
            self._timer.cancel()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(30)
        if self.async_engine is not None:
            self.async_engine.shutdown()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
