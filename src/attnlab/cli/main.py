"""The ``attnlab`` command. One module per subcommand, listed in :data:`SUBCOMMANDS`.

Each subcommand module defines ``add_parser(subparsers)``, which registers its
parser and sets ``func`` (called with the parsed args, returning an exit code).
Subcommand modules keep heavy imports inside their functions, so ``--help`` is fast.

Errors are handled here, once, for every subcommand (see ``docs/errors.md``): a user
error never ends in a traceback but in one line on stderr, ``attnlab CMD: error: ...``,
and the exit status says what kind it was:

* 2: an argument is malformed or out of range (argparse's own errors, and the
  ``ValueError``/``TypeError`` the library raises about a value it was given);
* 1: the arguments were well formed but the work failed: a missing or damaged model
  folder (:class:`~attnlab.errors.ModelFileError`), a model that computed NaN
  (:class:`~attnlab.errors.NonFiniteError`), an unwritable output (``OSError``), a
  missing optional dependency (``ImportError``), or an unexpected error (whose traceback
  ``-v`` shows);
* 130: interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

SUBCOMMANDS: list[str] = [
    "demo",
    "generate",
    "chat",
    "perplexity",
    "convert",
    "estimate",
    "advise",
    "diagnose",
    "visualize",
    "backends",
    "embed",
    "train",
    "serve",
    "distill",
    "finetune",
    "experiment",
]

EXIT_FAILURE = 1  # valid arguments, the work failed
EXIT_USAGE = 2  # malformed or out-of-range arguments


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``attnlab CMD: error: argument --x: ...`` and status 2.

    Subparsers are built from the same class (argparse's default ``parser_class``).
    """

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {_one_line(message)} (see --help)\n")


def _one_line(message: str) -> str:
    return "; ".join(line.strip() for line in str(message).splitlines() if line.strip())


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="attnlab",
        description="Transformer self-attention and its variants: run, inspect, measure.",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log debug messages; tracebacks of failures"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"attnlab.cli.{name}").add_parser(sub)
    return parser


def _describe(e: BaseException) -> str:
    """The one line shown for ``e``."""
    if isinstance(e, OSError) and e.strerror:
        what = e.strerror
        if e.filename is not None:
            what += f": {os.fsdecode(e.filename)!r}"
        return _one_line(what)
    if isinstance(e, KeyError):  # str(KeyError) is the bare key
        return f"missing key {e.args[0]!r}" if e.args else "missing key"
    return _one_line(str(e)) or type(e).__name__


def exit_status(e: BaseException) -> int:
    """The exit status for an exception raised by a subcommand (see the module docstring)."""
    from attnlab.errors import ModelFileError, NonFiniteError

    if isinstance(e, ModelFileError | NonFiniteError | OSError | ImportError | MemoryError):
        return EXIT_FAILURE
    if isinstance(e, ValueError | TypeError):
        return EXIT_USAGE
    return EXIT_FAILURE


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; return its exit status (argparse's ``--help`` and errors included)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a malformed argument (2, already printed)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_USAGE)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s: %(message)s",
    )
    from attnlab.cli._common import ReportedFailure

    try:
        code: int = args.func(args)
    except ReportedFailure as e:  # the report is printed (as JSON too): one line says why
        print(f"attnlab {args.command}: error: {_one_line(str(e))}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print(f"attnlab {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`attnlab ... | head`): nothing left to say to it
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILURE
    except Exception as e:
        status = exit_status(e)
        known = isinstance(e, ValueError | TypeError | OSError | ImportError | MemoryError)
        if args.verbose:
            traceback.print_exc()
        what = _describe(e)
        if not known:  # a bug, not a user error: say where to look
            what = f"internal error ({type(e).__name__}): {what}; run with -v for the traceback"
        print(f"attnlab {args.command}: error: {what}", file=sys.stderr)
        if getattr(args, "json", False):  # --json: stdout holds one JSON document, even now
            from attnlab.cli._common import print_json

            print_json({"error": what, "status": status, "command": args.command})
        return status
    if code:  # a command that failed without saying why: never a silent non-zero status
        print(f"attnlab {args.command}: error: exit status {code}", file=sys.stderr)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
