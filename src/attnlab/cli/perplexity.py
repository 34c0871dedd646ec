"""``attnlab perplexity MODEL FILE|-``: a causal LM's perplexity on a text, by sliding window.

MODEL is a ``.gguf`` file, a model folder, or ``SmolLM2-135M-Instruct`` (the packaged
model). The text is tokenized whole, then scored in windows of ``--context`` tokens
``--stride`` apart (see :mod:`attnlab.analysis.perplexity`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attnlab.cli._common import int_at_least, positive_int, print_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "perplexity",
        help="perplexity of a language model on a text (strided sliding window)",
        description=(
            "Score every token of FILE ('-' for stdin) with MODEL (a .gguf file, a model "
            "folder, or SmolLM2-135M-Instruct): windows of --context tokens, --stride apart, "
            "each token scored once with up to context - stride tokens of left context."
        ),
        epilog="example:\n  attnlab perplexity SmolLM2-135M-Instruct notes.txt --context 512",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model", metavar="MODEL", help="a .gguf file, a folder, or SmolLM2-135M-Instruct"
    )
    p.add_argument("file", metavar="FILE", help="a UTF-8 text file, or - for stdin")
    p.add_argument("--context", type=int_at_least(2), default=512, help="window length (tokens)")
    p.add_argument(
        "--stride", type=positive_int, default=None, help="window step (default context // 2)"
    )
    p.add_argument(
        "--max-tokens", type=int_at_least(2), default=None, help="score only the first N tokens"
    )
    p.add_argument(
        "--kv-dtype",
        choices=["float", "int8", "int4", "int2"],
        default="float",
        help="decode each window through a KV cache stored in this dtype (KIVI: keys per "
        "channel, values per token, the newest --kv-residual tokens in float); "
        "float: one forward per window, no cache",
    )
    p.add_argument(
        "--kv-key-mode",
        choices=["channel", "token"],
        default="channel",
        help="quantize keys per channel in groups of 32 tokens (KIVI) or per token",
    )
    p.add_argument(
        "--kv-residual", type=int_at_least(0), default=32, help="newest tokens kept in float"
    )
    p.add_argument(
        "--kv-chunk", type=positive_int, default=16, help="tokens per forward through the cache"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def _read_text(name: str) -> str:
    if name == "-":
        return sys.stdin.read()
    path = Path(name)
    if not path.is_file():
        raise OSError(2, f"FILE {name!r} does not exist or is not a file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"FILE {name!r} is not UTF-8 text ({e})") from None


def run(args: argparse.Namespace) -> int:
    from attnlab.analysis.perplexity import strided_perplexity
    from attnlab.interop.causal_lm import load_causal_lm

    stride = args.stride if args.stride is not None else max(args.context // 2, 1)
    if stride > args.context:
        raise ValueError(f"--stride {stride} must be at most --context {args.context}")
    text = _read_text(args.file)
    if not text.strip():
        raise ValueError(f"FILE {args.file!r} holds no text")
    lm = load_causal_lm(args.model, progress=True)
    window = lm.model.config.max_position_embeddings
    if args.context > window:
        raise ValueError(f"--context {args.context} exceeds {lm.name}'s context window {window}")
    if lm.tokenizer is None:
        raise ValueError(f"{lm.source} has no tokenizer (tokenizer.json) to read the text with")
    ids = list(lm.tokenizer.encode(text, add_special_tokens=False))
    if args.max_tokens is not None:
        ids = ids[: args.max_tokens]
    if len(ids) < 2:
        raise ValueError(f"the text is {len(ids)} token(s); perplexity needs at least 2")
    from tqdm.auto import tqdm

    bar = tqdm(desc="windows", unit="window", leave=False, file=sys.stderr, disable=None)

    def tick(done: int, total: int) -> None:
        bar.total = total
        bar.update(1)

    cache = _kv_cache(lm.model, args)
    try:
        result = strided_perplexity(
            lm.model,
            ids,
            context=args.context,
            stride=stride,
            on_window=tick,
            cache=cache,
            chunk=args.kv_chunk,
        )
    finally:
        bar.close()
    if args.json:
        kv = {"kv_dtype": args.kv_dtype}
        if cache is not None:
            kv |= {"kv_key_mode": args.kv_key_mode, "kv_residual": args.kv_residual}
            kv |= {"kv_chunk": args.kv_chunk}
        print_json({"model": lm.name, "file": args.file} | kv | result.to_dict())
    else:
        print(
            f"{lm.name}: perplexity {result.perplexity:.4f} over {result.tokens} tokens "
            f"(context {result.context}, stride {result.stride}, {result.windows} windows, "
            f"KV cache {args.kv_dtype}) in "
            f"{result.seconds:.1f} s, {result.tokens_per_second:.0f} tokens/s"
        )
    return 0


def _kv_cache(model: Any, args: argparse.Namespace) -> Callable[[], Any] | None:
    """A factory of fresh quantized model caches for ``--kv-dtype``, or None for float."""
    if args.kv_dtype == "float":
        return None
    from attnlab.cache.quantized import quantize_model_cache

    if not callable(getattr(model, "new_cache", None)):
        raise ValueError(f"--kv-dtype {args.kv_dtype} needs an attnlab model with KV caches")
    settings = {"kv_dtype": args.kv_dtype, "key_mode": args.kv_key_mode}
    settings["residual"] = args.kv_residual
    quantize_model_cache(model.new_cache(), **settings)  # refuses unsupported layers now

    def fresh() -> Any:
        return quantize_model_cache(model.new_cache(), **settings)

    return fresh
