"""Helpers shared by subcommands: argument types, strict JSON output, a progress display,
and loading a model with its tokenizer.

The argument types (:func:`positive_int`, :func:`positive_float`, ...) run the library's
number checks while argparse parses, so a malformed or out-of-range value ends in one
line naming the argument and the value, with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from attnlab._files import writable_dir as writable_dir
from attnlab._files import writable_file as writable_file
from attnlab._validate import check_int, check_real, check_seed

T = TypeVar("T")


class ReportedFailure(Exception):
    """The command printed its report, and the report says the work did not succeed.

    :func:`attnlab.cli.main.main` prints ``attnlab CMD: error: MESSAGE`` on stderr and
    exits 1 (``advise`` whose advice does not fit, ``diagnose`` that found a fault), so a
    non-zero status always comes with a line saying why.
    """


# ------------------------------------------------------------------------- argument types


def _number_type(
    name: str, parse: Callable[[str], Any], check: Callable[[Any], Any]
) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {name}, got {text!r}") from None
        try:
            return check(value)
        except (ValueError, TypeError) as e:
            # "value must be ..., got ...": argparse prefixes the argument's name
            raise argparse.ArgumentTypeError(str(e).removeprefix("value ")) from None

    convert.__name__ = name.replace(" ", "_")
    return convert


positive_int = _number_type("a positive int", int, lambda v: check_int("value", v, min_value=1))
nonnegative_int = _number_type("an int >= 0", int, lambda v: check_int("value", v, min_value=0))
any_int = _number_type("an int", int, lambda v: check_int("value", v))
positive_float = _number_type("a number > 0", float, lambda v: check_real("value", v, gt=0.0))
nonnegative_float = _number_type("a number >= 0", float, lambda v: check_real("value", v, ge=0.0))


def int_at_least(low: int) -> Callable[[str], int]:
    """An argument type for ints ``>= low``, checked by :func:`attnlab._validate.check_int`."""
    return _number_type(f"an int >= {low}", int, lambda v: check_int("value", v, min_value=low))


seed_int = _number_type("a seed", int, lambda v: check_seed("value", v))
"""An argument type for ``--seed``: an int in ``[0, 2**63 - 1]`` (:func:`check_seed`)."""

port_number = _number_type(
    "a port number", int, lambda v: check_int("value", v, min_value=1, max_value=65535)
)
probability_float = _number_type(
    "a number in (0, 1]", float, lambda v: check_real("value", v, gt=0.0, le=1.0)
)


def token_ids(text: str) -> list[int]:
    """``'1 2 3'`` (spaces or commas) as a list of ints >= 0, for ``--ids``."""
    parts = text.replace(",", " ").split()
    if not parts:
        raise argparse.ArgumentTypeError(f"expected token ids such as '1 2 3', got {text!r}")
    ids = []
    for p in parts:
        try:
            ids.append(check_int("value", int(p), min_value=0))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected token ids (ints >= 0) such as '1 2 3', got {p!r} in {text!r}"
            ) from None
    return ids


# ------------------------------------------------------------------------- strict JSON


def strict_json(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by ``None``, and the reason recorded.

    In each object that held such a value a key ``"non_finite"`` maps the field (with its
    list index, as ``"values[3]"``) to ``"nan"``, ``"inf"`` or ``"-inf"``: strict JSON has
    no NaN or Infinity, and a reader should still learn why a number is missing.
    """

    def fix(value: Any, path: str, found: dict[str, str]) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            found[path] = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
            return None
        if isinstance(value, dict):
            return fix_dict(value)
        if isinstance(value, list | tuple):
            return [fix(v, f"{path}[{i}]", found) for i, v in enumerate(value)]
        return value

    def fix_dict(d: dict[Any, Any]) -> dict[Any, Any]:
        found: dict[str, str] = {}
        out = {k: fix(v, str(k), found) for k, v in d.items()}
        if found:
            out["non_finite"] = found
        return out

    if isinstance(obj, dict):
        return fix_dict(obj)
    top: dict[str, str] = {}
    fixed = fix(obj, "", top)
    if top:  # a bare number or a list of numbers at the top: wrap to say why
        return {"value": fixed, "non_finite": top}
    return fixed


def print_json(obj: Any) -> None:
    """Print ``obj`` as strict JSON (RFC 8259: no NaN/Infinity; see :func:`strict_json`)."""
    print(json.dumps(strict_json(obj), indent=2, allow_nan=False))


# ------------------------------------------------------------------------- output paths
# writable_dir / writable_file live in attnlab._files (the library checks its outputs
# before the work too) and are re-exported here for the subcommands.


class Progress:
    """Steps and bars on stderr, for work that takes more than a moment.

    ``step("loading model")`` prints a numbered line with the elapsed time;
    ``bar(items, "layers")`` redraws ``[#####     ] 3/6 layers`` in place on a terminal
    and prints one line per item otherwise. ``quiet=True`` prints nothing.
    """

    def __init__(self, total_steps: int, *, quiet: bool = False) -> None:
        self.total = total_steps
        self.done = 0
        self.quiet = quiet
        self.start = time.perf_counter()

    def step(self, what: str) -> None:
        self.done += 1
        if not self.quiet:
            elapsed = time.perf_counter() - self.start
            print(
                f"[{self.done}/{self.total}] {what} ({elapsed:.1f} s)", file=sys.stderr, flush=True
            )

    def tick(self, i: int, n: int, what: str) -> None:
        """Show that ``i`` of ``n`` items are done."""
        if self.quiet:
            return
        tty = sys.stderr.isatty()
        filled = int(20 * i / max(n, 1))
        line = f"    [{'#' * filled}{' ' * (20 - filled)}] {i}/{n} {what}"
        end = "" if tty and i < n else "\n"
        print(("\r" + line) if tty else line, end=end, file=sys.stderr, flush=True)

    def bar(self, items: Iterable[T], what: str) -> Iterator[T]:
        """Yield ``items``, showing the bar as each one is finished."""
        seq = list(items)
        for i, item in enumerate(seq, 1):
            yield item
            self.tick(i, len(seq), what)


def load_model(path: str | None) -> tuple[Any, Any, str]:
    """``(attnlab model, tokenizer, name)`` from a local Hugging Face folder or a ``.gguf``
    file (default all-MiniLM-L6-v2)."""
    import attnlab
    from attnlab.interop.hf import require_transformers

    if path is not None and Path(path).suffix.lower() == ".gguf":
        model = attnlab.from_gguf(path, progress=True)
        return model, model.tokenizer, Path(path).stem
    if path is None:
        from attnlab.interop.pretrained import minilm_path

        folder = minilm_path()
        name = "all-MiniLM-L6-v2"
    else:
        folder = Path(path)
        name = folder.name
    # The model first: a missing or damaged folder is reported by attnlab, naming the file,
    # before transformers' tokenizer loader looks for files (and fails less clearly).
    model = attnlab.from_hf(folder).eval()
    tf = require_transformers()
    tf.utils.logging.disable_progress_bar()
    try:
        tokenizer = tf.AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, KeyError, TypeError) as e:
        from attnlab.errors import ModelFileError

        raise ModelFileError(f"{folder}: the tokenizer cannot be loaded: {e}") from None
    return model, tokenizer, name


def use_inductor_cache() -> str:
    """Point ``TORCHINDUCTOR_CACHE_DIR`` at ``~/.cache/attnlab/inductor`` (beside the built
    kernels: ``ATTNLAB_KERNEL_CACHE``'s parent, or ``$XDG_CACHE_HOME/attnlab``) unless it
    is set, and return it. Call it before anything calls ``torch.compile``: that sets the
    variable to inductor's default (``/tmp/torchinductor_$USER``) when it is unset."""
    import os

    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        kernels = os.environ.get("ATTNLAB_KERNEL_CACHE")
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = Path(kernels).parent if kernels else Path(base) / "attnlab"
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]
