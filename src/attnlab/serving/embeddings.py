"""``POST /v1/embeddings``: sentence embeddings from an encoder with a pooling config.

An :class:`EmbeddingService` owns an attnlab encoder loaded from a sentence-transformers
folder (all-MiniLM-L6-v2, ...: ``modules.json``, ``1_Pooling/config.json``), so the
embeddings are :meth:`~attnlab.models.EncoderModel.encode`'s: the folder's pooling and
normalisation, run packed (many texts per row, no compute on padding). Requests are
checked in the event loop (types, lengths, vocabulary) and queued; a worker thread takes
everything queued at once and encodes it in one packed call, so concurrent requests are
batched together, and splits the result back.

Request fields (:data:`~attnlab.serving.protocol.EMBEDDING_FIELDS`): ``input`` (a string,
a list of strings, token ids, or a list of token-id lists, ``[CLS]``/``[SEP]``
included as given), ``encoding_format`` (``float`` or ``base64``: little-endian float32
bytes), ``dimensions`` (keep the first ``d`` values and L2-renormalise, OpenAI's
shortening), ``user`` (no effect). An input longer than the folder's
``max_seq_length`` is refused (400), never silently truncated.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import queue
import threading
from pathlib import Path
from typing import Any

import torch

from attnlab.serving.protocol import EMBEDDING_FIELDS, APIError, check_fields, check_text

__all__ = ["EmbeddingService", "is_embedding_folder", "load_embeddings"]

log = logging.getLogger(__name__)


def is_embedding_folder(path: str | Path) -> bool:
    """Whether ``path`` is a sentence-transformers folder (a pooling config beside the weights)."""
    folder = Path(path)
    return folder.is_dir() and (
        (folder / "modules.json").is_file() or (folder / "1_Pooling" / "config.json").is_file()
    )


def load_embeddings(path: str | Path, *, model_name: str | None = None) -> EmbeddingService:
    """An :class:`EmbeddingService` for a sentence-transformers folder.

    Raises:
        ValueError: the folder holds no encoder, or has no tokenizer.
    """
    import attnlab

    folder = Path(path)
    model = attnlab.from_hf(folder).eval()
    if not hasattr(model, "encode") or getattr(model, "tokenizer", None) is None:
        raise ValueError(
            f"{folder} is not an encoder with a tokenizer (got {type(model).__name__}); "
            "embeddings need a sentence-transformers folder such as all-MiniLM-L6-v2"
        )
    return EmbeddingService(model, model_name=model_name or folder.name)


class EmbeddingService:
    """Serves one encoder's embeddings; batches concurrent requests in a worker thread.

    Args:
        model: an attnlab encoder with ``encode``, ``tokenizer`` and ``sentence_settings``.
        model_name: the model id clients pass as ``model``.
        max_batch_texts: the most texts encoded in one call.
    """

    def __init__(self, model: Any, *, model_name: str, max_batch_texts: int = 256) -> None:
        self.model = model
        self.model_name = model_name
        self.max_batch_texts = max_batch_texts
        limit = int(model.config.max_position_embeddings)
        settings = model.sentence_settings
        self.max_len = min((settings.max_seq_length if settings else None) or limit, limit)
        self.vocab_size = int(model.config.vocab_size)
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.batches = 0  # encode calls made (batches of one or more requests)

    # ------------------------------------------------------------------ worker

    def start(self) -> None:
        """Start the worker thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="attnlab-embed", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the worker after its current batch."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            jobs = [job]
            count = len(job[0])
            while count < self.max_batch_texts:
                try:
                    more = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._jobs.put(None)
                    break
                jobs.append(more)
                count += len(more[0])
            self._encode(jobs)

    def _encode(self, jobs: list[Any]) -> None:
        ids = [seq for seqs, _, _ in jobs for seq in seqs]
        try:
            with torch.inference_mode():
                vectors = self.model.encode(ids, strategy="packed")  # [N, D]
            self.batches += 1
        except Exception as e:  # every job of the batch gets the error; the worker goes on
            log.exception("encoding failed")
            for _, loop, fut in jobs:
                loop.call_soon_threadsafe(_settle, fut, None, e)
            return
        start = 0
        for seqs, loop, fut in jobs:
            part = vectors[start : start + len(seqs)]
            start += len(seqs)
            loop.call_soon_threadsafe(_settle, fut, part, None)

    async def embed(self, ids: list[list[int]]) -> torch.Tensor:
        """``[N, D]`` embeddings of token-id lists (checked), batched with other requests."""
        if self._thread is None:
            raise APIError(503, "the embedding worker is not running", code="engine_stopped")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[torch.Tensor] = loop.create_future()
        self._jobs.put((ids, loop, fut))
        return await fut

    # ------------------------------------------------------------------ requests

    def token_ids(self, raw: Any) -> list[list[int]]:
        """The ``input`` field as token-id lists, each checked against the limits.

        Raises:
            APIError: 400 naming ``input``.
        """
        if isinstance(raw, str):
            items: list[Any] = [raw]
        elif isinstance(raw, list) and raw and all(_is_id(t) for t in raw):
            items = [raw]
        elif isinstance(raw, list) and raw:
            items = raw
        else:
            raise APIError(
                400,
                "input must be a string, a list of strings, token ids or lists of token ids",
                param="input",
            )
        if len(items) > 2048:
            raise APIError(400, f"input holds {len(items)} items; at most 2048", param="input")
        backend = getattr(self.model.tokenizer, "backend_tokenizer", self.model.tokenizer)
        out: list[list[int]] = []
        for i, item in enumerate(items):
            if isinstance(item, str):
                if not item:
                    raise APIError(400, f"input[{i}] is an empty string", param="input")
                seq = list(backend.encode(item).ids)
            elif isinstance(item, list) and item and all(_is_id(t) for t in item):
                seq = [int(t) for t in item]
                if max(seq) >= self.vocab_size:
                    raise APIError(
                        400,
                        f"input[{i}]: token ids must lie in [0, {self.vocab_size})",
                        param="input",
                    )
            else:
                raise APIError(
                    400,
                    f"input[{i}] must be a string or a non-empty list of token ids",
                    param="input",
                )
            if len(seq) > self.max_len:
                raise APIError(
                    400,
                    f"input[{i}] has {len(seq)} tokens; this model takes at most "
                    f"{self.max_len} (max_seq_length)",
                    param="input",
                )
            out.append(seq)
        return out

    async def handle(self, request: Any) -> dict[str, Any]:
        """Answer one ``POST /v1/embeddings``."""
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        check_text(body)
        if body.get("model") != self.model_name:
            raise APIError(
                404,
                f"unknown embedding model {body.get('model')!r}; this server embeds with "
                f"{self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        check_fields(body, EMBEDDING_FIELDS)
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise APIError(
                400,
                f"encoding_format must be 'float' or 'base64', got {fmt!r}",
                param="encoding_format",
            )
        ids = self.token_ids(body.get("input"))
        vectors = await self.embed(ids)
        dims = body.get("dimensions")
        if dims is not None:
            width = vectors.shape[-1]
            if not _is_id(dims) or not 1 <= dims <= width:
                raise APIError(
                    400,
                    f"dimensions must be an int in [1, {width}], got {dims!r}",
                    param="dimensions",
                )
            vectors = torch.nn.functional.normalize(vectors[:, :dims], dim=-1)
        data = [
            {"object": "embedding", "index": i, "embedding": _encode_vector(v, fmt)}
            for i, v in enumerate(vectors)
        ]
        tokens = sum(map(len, ids))
        return {
            "object": "list",
            "data": data,
            "model": self.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    def add_routes(self, app: Any) -> None:
        """Register ``POST /v1/embeddings`` on a FastAPI app."""
        from fastapi import Request
        from fastapi.responses import JSONResponse

        async def embeddings(request: Request) -> JSONResponse:
            return JSONResponse(await self.handle(request))

        # FastAPI reads the annotations at run time; this module's are strings
        embeddings.__annotations__ = {"request": Request, "return": JSONResponse}
        app.add_api_route("/v1/embeddings", embeddings, methods=["POST"])


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _encode_vector(v: torch.Tensor, fmt: str) -> Any:
    if fmt == "base64":
        return base64.b64encode(v.float().numpy().astype("<f4").tobytes()).decode("ascii")
    return v.tolist()


def _settle(fut: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if fut.done():  # the client went away
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)
