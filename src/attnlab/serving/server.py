"""Run the OpenAI-compatible app with uvicorn, in the foreground or in a thread (tests, benchmarks)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from attnlab.serving.async_engine import AsyncEngine
from attnlab.serving.engine import Engine
from attnlab.serving.openai_api import build_app

__all__ = ["BackgroundServer", "load_engine"]


def load_engine(model_dir: str | Path, **engine_kwargs: Any) -> tuple[Engine, str]:
    """``(engine, model name)`` for a transformers-style folder (config, safetensors, tokenizer).

    Raises:
        ValueError: the folder is missing, has no tokenizer, or holds an architecture
            attnlab cannot serve (an encoder, an encoder-decoder).
    """
    import attnlab
    from attnlab.errors import ModelFileError
    from attnlab.interop.checkpoints import check_model_folder, read_config
    from attnlab.interop.hf import require_transformers

    folder = check_model_folder(model_dir)
    read_config(folder)  # a missing or malformed config.json, named
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ModelFileError(f"{folder} has no tokenizer files (tokenizer.json)")
    tf = require_transformers()
    tf.utils.logging.disable_progress_bar()
    tokenizer = tf.AutoTokenizer.from_pretrained(str(folder))
    model = attnlab.from_hf(folder).eval()
    if getattr(model, "is_encoder_decoder", False) or not hasattr(model, "lm_head"):
        raise ValueError(
            f"{folder} holds a {type(model).__name__}; attnlab serve runs decoder-only language models"
        )
    return Engine(model, tokenizer, **engine_kwargs), folder.name


class BackgroundServer:
    """uvicorn serving an engine on ``127.0.0.1`` in a daemon thread, stopped by :meth:`stop`
    or after ``max_seconds`` (so a test or benchmark can never leave it running).

    Args:
        engine: the engine.
        model_name: the model id of the API.
        port: 0 picks a free port (read :attr:`port` after :meth:`start`).
        api_key: see :func:`~attnlab.serving.openai_api.build_app`.
        max_seconds: the server stops itself after this long.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        model_name: str = "attnlab",
        port: int = 0,
        api_key: str | None = None,
        max_seconds: float = 600.0,
    ) -> None:
        import uvicorn

        self.async_engine = AsyncEngine(engine)
        app = build_app(self.async_engine, model_name=model_name, api_key=api_key)
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
        self.async_engine.shutdown()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
