"""An instruction set every machine has: questions on the standard library's docstrings.

For the public functions and classes of a fixed list of standard-library modules, the
question "what does the function `module.name` do?" is answered by the first paragraph of
its docstring (40 to 400 characters). The rows are chat JSONL rows
(``{"messages": [...]}``) for :mod:`attnlab.train.finetune`; the set is the same on every
machine with the same Python version.
"""

from __future__ import annotations

import importlib
import inspect
import re

__all__ = ["MODULES", "stdlib_docstring_rows"]

MODULES = [
    "base64", "bisect", "calendar", "collections", "colorsys", "contextlib", "copy", "csv",
    "dataclasses", "difflib", "filecmp", "fnmatch", "fractions", "functools", "glob", "gzip",
    "heapq", "html", "inspect", "ipaddress", "itertools", "json", "keyword", "linecache",
    "operator", "os.path", "pathlib", "pprint", "queue", "random", "re", "secrets", "shlex",
    "shutil", "statistics", "string", "tempfile", "textwrap", "tokenize", "urllib.parse",
    "uuid", "zipfile",
]  # fmt: skip


def _first_paragraph(doc: str) -> str:
    para = inspect.cleandoc(doc).split("\n\n")[0]
    return re.sub(r"\s+", " ", para).strip()


def stdlib_docstring_rows() -> list[dict[str, object]]:
    """One question per documented public function or class (answers of 40-400 chars)."""
    rows: list[dict[str, object]] = []
    for name in MODULES:
        mod = importlib.import_module(name)
        for attr in sorted(dir(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr)
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            if getattr(obj, "__module__", None) not in (mod.__name__, name):
                continue  # re-exported from elsewhere
            doc = inspect.getdoc(obj)
            if not doc:
                continue
            answer = _first_paragraph(doc)
            if not 40 <= len(answer) <= 400:
                continue
            kind = "class" if inspect.isclass(obj) else "function"
            q = f"In Python's standard library, what does the {kind} `{name}.{attr}` do?"
            rows.append(
                {
                    "messages": [
                        {"role": "user", "content": q},
                        {"role": "assistant", "content": answer},
                    ]
                }
            )
    return rows
