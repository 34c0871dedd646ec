"""Helpers shared by subcommands: a progress display and loading a model with its tokenizer."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


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
    """``(attnlab model, tokenizer, name)`` from a local Hugging Face folder (default all-MiniLM-L6-v2)."""
    import attnlab
    from attnlab.interop.hf import require_transformers

    if path is None:
        from attnlab.interop.pretrained import minilm_path

        folder = minilm_path()
        name = "all-MiniLM-L6-v2"
    else:
        folder = Path(path)
        name = folder.name
    tf = require_transformers()
    tf.utils.logging.disable_progress_bar()
    tokenizer = tf.AutoTokenizer.from_pretrained(folder)
    model = attnlab.from_hf(folder).eval()
    return model, tokenizer, name
