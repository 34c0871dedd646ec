"""The ``attnlab`` command. One module per subcommand, listed in :data:`SUBCOMMANDS`.

Each subcommand module defines ``add_parser(subparsers)``, which registers its
parser and sets ``func`` (called with the parsed args, returning an exit code).
Subcommand modules keep heavy imports inside their functions, so ``--help`` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

SUBCOMMANDS: list[str] = [
    "demo",
    "generate",
    "estimate",
    "advise",
    "diagnose",
    "visualize",
    "backends",
    "embed",
    "serve",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnlab",
        description="Transformer self-attention and its variants: run, inspect, measure.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"attnlab.cli.{name}").add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s: %(message)s",
    )
    try:
        code: int = args.func(args)
    except (ValueError, TypeError, ImportError) as e:
        print(f"attnlab {args.command}: error: {e}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
