"""``attnlab demo``: a walk-through of self-attention on a real pretrained model."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="walk through self-attention on all-MiniLM-L6-v2")
    p.add_argument("--text", default="time flies like an arrow", help="the sentence to look at")
    p.add_argument("--out", default="attnlab-demo", help="folder for the heatmaps")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raise NotImplementedError
