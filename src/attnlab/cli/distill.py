"""``attnlab distill``: a student sentence encoder with half the teacher's layers, measured."""

from __future__ import annotations

import argparse
import json
from typing import Any

from attnlab._validate import check_int
from attnlab.cli._common import nonnegative_float, positive_float, positive_int


def _layers(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated layer indices such as 1,3,5, got {text!r}"
        ) from None
    try:
        return tuple(check_int("layer indices", i, min_value=0) for i in out)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e} in {text!r}") from None


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "distill",
        help="distil all-MiniLM-L6-v2 (or a given sentence encoder) into fewer layers",
        description=(
            "Distil a sentence-embedding BERT into a student that keeps some of its layers "
            "(default 1,3,5 of 6), trained on docstrings of the Python standard library to "
            "reproduce the teacher's embeddings, last-layer states and attention. Reports the "
            "Spearman correlation of the student's pairwise cosine similarities with the "
            "teacher's on held-out sentences, and the encode speed of each. The student folder "
            "loads with attnlab.from_hf, transformers and sentence-transformers."
        ),
        epilog="example:\n  attnlab distill --out minilm-l3 --steps 600",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--teacher", help="sentence-transformers folder (default all-MiniLM-L6-v2)")
    p.add_argument("--out", help="save the student folder here")
    p.add_argument("--layers", type=_layers, default=(1, 3, 5), help="teacher layers kept")
    p.add_argument("--steps", type=positive_int, default=600, help="optimiser steps (600)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="sentences per step")
    p.add_argument("--eval-sentences", type=positive_int, default=500, help="held-out sentences")
    p.add_argument("--seed", type=int, default=0, help="seed (0)")
    p.add_argument(
        "--lr",
        type=positive_float,
        default=1e-4,
        help="AdamW learning rate, warm-up then cosine (1e-4)",
    )
    for name, default, what in (
        ("embedding", 1.0, "MSE between normalised sentence embeddings"),
        ("similarity", 1.0, "in-batch cosine-similarity matrices"),
        ("attention", 1.0, "MiniLM attention transfer on the last layer (0 = off)"),
        ("hidden", 1.0, "last-layer token states (0 = off)"),
    ):
        p.add_argument(
            f"--{name}-weight",
            type=nonnegative_float,
            default=default,
            help=f"weight of the {what} term ({default:g})",
        )
    p.add_argument(
        "--device",
        default="auto",
        help="where the student trains: auto (CUDA when available), cpu, cuda, cuda:N; "
        "encode speed is measured on the CPU",
    )
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from attnlab.train.distill import DistillConfig, distill_sentence_encoder

    cfg = DistillConfig(
        layers=args.layers,
        steps=args.steps,
        batch_size=args.batch_size,
        eval_sentences=args.eval_sentences,
        seed=args.seed,
        lr=args.lr,
        embedding_weight=args.embedding_weight,
        similarity_weight=args.similarity_weight,
        attention_weight=args.attention_weight,
        hidden_weight=args.hidden_weight,
        device=args.device,
    )
    r = distill_sentence_encoder(args.teacher, config=cfg, out=args.out, progress=not args.json)
    if args.json:
        print(json.dumps(r.to_dict(), indent=2, allow_nan=False))
        return 0
    print(
        f"student: {r.student_layers} of {r.teacher_layers} layers, {r.steps} steps in "
        f"{r.seconds:.0f} s (final loss {r.final_loss:.4f})\n"
        f"Spearman of pairwise cosine similarities vs the teacher (held out): {r.spearman:.4f} "
        f"(at initialisation {r.spearman_at_init:.4f})\n"
        f"encode speed: teacher {r.teacher_sentences_per_s:.0f} sentences/s, student "
        f"{r.student_sentences_per_s:.0f} sentences/s on the CPU ({r.threads} threads): "
        f"{r.speedup:.2f}x" + (f"\nsaved to {r.out}" if r.out else "")
    )
    return 0
