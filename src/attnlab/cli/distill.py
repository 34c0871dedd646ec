"""``attnlab distill``: a student sentence encoder with half the teacher's layers, measured."""

from __future__ import annotations

import argparse
import json
from typing import Any

from attnlab._validate import check_int
from attnlab.cli._common import (
    nonnegative_float,
    positive_float,
    positive_int,
    seed_int,
    writable_dir,
)


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
            "(by default three of six), trained on docstrings of the Python standard library to "
            "reproduce the teacher's sentence embeddings and their pairwise similarities "
            "(optionally its last-layer states and attention). Reports the "
            "Spearman correlation of the student's pairwise cosine similarities with the "
            "teacher's on held-out sentences, and the encode speed of each. The student folder "
            "loads with attnlab.from_hf, transformers and sentence-transformers."
        ),
        epilog="defaults: attnlab.train.distill.DistillConfig\n"
        "example:\n  attnlab distill --out minilm-l3",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--teacher", help="sentence-transformers folder (default all-MiniLM-L6-v2)")
    p.add_argument("--out", help="save the student folder here")
    # defaults live in DistillConfig alone: an option left out keeps the config's value
    p.add_argument("--layers", type=_layers, help="teacher layers kept, e.g. 0,3,5")
    p.add_argument("--steps", type=positive_int, help="optimiser steps")
    p.add_argument("--batch-size", type=positive_int, help="sentences per step")
    p.add_argument("--eval-sentences", type=positive_int, help="held-out sentences")
    p.add_argument("--seed", type=seed_int, help="seeds the data order and the initial weights")
    p.add_argument("--lr", type=positive_float, help="AdamW learning rate, warm-up then cosine")
    for name, what in (
        ("embedding", "MSE between normalised sentence embeddings"),
        ("similarity", "in-batch cosine-similarity matrices"),
        ("attention", "MiniLM attention transfer on the last layer (0 = off)"),
        ("hidden", "last-layer token states (0 = off)"),
    ):
        p.add_argument(
            f"--{name}-weight", type=nonnegative_float, help=f"weight of the {what} term"
        )
    p.add_argument(
        "--device",
        help="where the student trains: auto (CUDA when available), cpu, cuda, cuda:N; "
        "encode speed is measured on the CPU",
    )
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from attnlab.train.distill import DistillConfig, distill_sentence_encoder

    names = (
        "layers",
        "steps",
        "batch_size",
        "eval_sentences",
        "seed",
        "lr",
        "embedding_weight",
        "similarity_weight",
        "attention_weight",
        "hidden_weight",
        "device",
    )
    cfg = DistillConfig(**{n: getattr(args, n) for n in names if getattr(args, n) is not None})
    if args.out is not None:  # before the work, naming the flag
        writable_dir("--out", args.out)
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
