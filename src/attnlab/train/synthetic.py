"""Synthetic sequence tasks, generated on the fly from a seed (no files).

Shape notation: ``B`` rows, ``L`` sequence length.

Each task returns ``(prompt [B, P], answer [B, A])`` with a fixed length for every row, so
batches have one shape. Token ids: ``0`` blank/noise, ``1`` separator, ``2`` query/trigger,
data symbols from ``3``; the vocabulary is ``num_symbols + 3``.

* ``copy``: ``x_1..x_n SEP`` -> ``x_1..x_n`` (Graves et al., 2014, "Neural Turing machines").
* ``associative_recall``: ``k_1 v_1 ... k_n v_n SEP q`` -> the value stored under key ``q``
  (Ba et al., 2016, "Using fast weights to attend to the recent past"; Zoology, Arora et
  al., 2023). Keys are distinct.
* ``selective_copy``: ``n`` data symbols scattered among blanks in ``L`` positions, then
  ``SEP`` -> the data symbols in order (Gu & Dao, 2023, "Mamba", section 3.1).
* ``induction``: a random context containing ``TRIGGER b`` once, ending with ``TRIGGER``
  -> ``b`` (Olsson et al., 2022, "In-context learning and induction heads").
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["NUM_SPECIAL", "SEP", "TRIGGER", "make_task", "task_vocab_size"]

BLANK, SEP, TRIGGER = 0, 1, 2
NUM_SPECIAL = 3


def task_vocab_size(num_symbols: int) -> int:
    """Vocabulary of the tasks over ``num_symbols`` data symbols."""
    return num_symbols + NUM_SPECIAL


def _symbols(b: int, n: int, num_symbols: int, g: torch.Generator) -> Tensor:
    return torch.randint(NUM_SPECIAL, NUM_SPECIAL + num_symbols, (b, n), generator=g)


def _copy(b: int, n: int, k: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    x = _symbols(b, n, k, g)  # [B, n]
    return torch.cat([x, torch.full((b, 1), SEP)], 1), x


def _associative_recall(b: int, n: int, k: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    if n > k:
        raise ValueError(
            f"associative_recall needs task_length ({n}) <= num_symbols ({k}) distinct keys"
        )
    keys = torch.argsort(torch.rand(b, k, generator=g), dim=1)[:, :n] + NUM_SPECIAL  # [B, n]
    values = _symbols(b, n, k, g)
    pairs = torch.stack([keys, values], 2).reshape(b, 2 * n)  # k_1 v_1 k_2 v_2 ...
    pick = torch.randint(0, n, (b, 1), generator=g)
    query = keys.gather(1, pick)
    prompt = torch.cat([pairs, torch.full((b, 1), SEP), query], 1)
    return prompt, values.gather(1, pick)


def _selective_copy(b: int, n: int, k: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    length = 4 * n  # data tokens fill a quarter of the context
    data = _symbols(b, n, k, g)
    slots = torch.sort(torch.argsort(torch.rand(b, length, generator=g), 1)[:, :n], 1).values
    ctx = torch.full((b, length), BLANK).scatter(1, slots, data)
    return torch.cat([ctx, torch.full((b, 1), SEP)], 1), data


def _induction(b: int, n: int, k: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    length = max(n, 4)
    ctx = _symbols(b, length, k, g)
    at = torch.randint(0, length - 2, (b, 1), generator=g)  # TRIGGER at `at`, its partner after
    ctx.scatter_(1, at, torch.full((b, 1), TRIGGER))
    answer = ctx.gather(1, at + 1)
    return torch.cat([ctx, torch.full((b, 1), TRIGGER)], 1), answer


_TASKS = {
    "copy": _copy,
    "associative_recall": _associative_recall,
    "selective_copy": _selective_copy,
    "induction": _induction,
}


def make_task(
    task: str, batch: int, *, length: int, num_symbols: int, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """``(prompt [B, P], answer [B, A])`` of ``task``, drawn from ``generator``.

    Raises:
        ValueError: an unknown task, or sizes the task cannot use.
    """
    if task not in _TASKS:
        raise ValueError(f"unknown task {task!r}; known: {sorted(_TASKS)}")
    return _TASKS[task](batch, length, num_symbols, generator)
