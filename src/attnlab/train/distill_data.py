"""What :mod:`attnlab.train.distill` trains and evaluates on: sentences, batches, a measure.

Docstring paragraphs of the Python standard library (text that exists offline on every
machine), split into a training and a held-out part by the hash of each file's path (as
:mod:`attnlab.train.data` splits its text), and batched by length; and the rank
correlation the student's similarities are scored by.
"""

from __future__ import annotations

import ast
import functools
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import Tensor

__all__ = [
    "HELD_OUT_PERCENT",
    "length_grouped_batches",
    "pairwise_cosines",
    "spearman",
    "stdlib_sentences",
    "trim",
]

#: Share of the standard library's files whose sentences are held out (by path hash).
HELD_OUT_PERCENT = 12


def _docstring_sentences(source: str) -> Iterator[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if not doc:
                continue
            for para in doc.split("\n\n"):
                text = " ".join(para.split())
                if 20 <= len(text) <= 400 and not text.startswith((">>>", "..")):
                    yield text


@functools.lru_cache(maxsize=2)
def _all_stdlib_sentences(held_out: bool) -> tuple[str, ...]:
    from attnlab.train.data import _bucket, stdlib_files

    root = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    out: list[str] = []
    for p in stdlib_files():
        if "test" in p.parts or "tests" in p.parts:
            continue
        if (_bucket(p, root) < HELD_OUT_PERCENT) != held_out:
            continue
        try:
            src = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for s in _docstring_sentences(src):
            if s not in seen:
                seen.add(s)
                out.append(s)
    return tuple(out)


def stdlib_sentences(*, held_out: bool, limit: int, seed: int = 0) -> list[str]:
    """Docstring paragraphs from the Python standard library's source, deduplicated.

    Files are split by the hash of their path that :mod:`attnlab.train.data` splits text
    with (:data:`HELD_OUT_PERCENT` of them held out), so held-out sentences come from files
    the training split never saw.

    Args:
        held_out: the held-out split (else the training split).
        limit: at most this many sentences (a seeded sample when there are more).
        seed: the sample's seed.
    """
    out = _all_stdlib_sentences(held_out)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(out), generator=g).tolist()
    return [out[i] for i in order[:limit]]


def length_grouped_batches(
    sents: Sequence[str], batch_size: int, g: torch.Generator, *, group: int = 64
) -> list[list[int]]:
    """One epoch of batches of similar-length sentences, in random order.

    The epoch is shuffled, cut into runs of ``group`` batches, each run sorted by length
    and cut into batches (the "group by length" sampling of transformers' Trainer): a batch
    is padded to its longest sentence, and docstring paragraphs run from 20 to 400
    characters, so random batches spend most of their tokens on padding.
    """
    order = torch.randperm(len(sents), generator=g).tolist()
    span = batch_size * group
    out: list[list[int]] = []
    for s in range(0, len(order), span):
        run = sorted(order[s : s + span], key=lambda i: len(sents[i]))
        out += [run[j : j + batch_size] for j in range(0, len(run), batch_size)]
    out = [b for b in out if len(b) == batch_size] or out
    perm = torch.randperm(len(out), generator=g).tolist()
    return [out[i] for i in perm]


def trim(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """``batch`` without the columns that are padding in every row."""
    keep = int(batch["attention_mask"].sum(1).max())
    return {k: v[:, :keep] for k, v in batch.items()}


def spearman(a: Tensor, b: Tensor) -> float:
    """Spearman rank correlation of two 1-D tensors (average ranks for ties)."""

    def rank(x: Tensor) -> Tensor:
        x = x.double()
        order = torch.argsort(x)
        r = torch.empty_like(x)
        r[order] = torch.arange(len(x), dtype=torch.float64)
        # average the ranks of ties
        uniq, inv = torch.unique(x, return_inverse=True)
        if len(uniq) < len(x):
            sums = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, r)
            counts = torch.zeros(len(uniq), dtype=torch.float64).index_add_(
                0, inv, torch.ones_like(r)
            )
            r = (sums / counts)[inv]
        return r

    ra, rb = rank(a), rank(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def pairwise_cosines(emb: Tensor) -> Tensor:
    """The cosines of every pair ``i < j`` of unit rows ``emb [n, D]``, ``[n (n - 1) / 2]``."""
    sim = emb @ emb.T
    iu = torch.triu_indices(len(emb), len(emb), offset=1)
    return sim[iu[0], iu[1]]
