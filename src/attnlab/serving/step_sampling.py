"""The engine's sampling call: one batched :func:`~attnlab.generation.sampler.sample` per
step, with each failure kept to the sequence that caused it.

The engine hands over the sequences whose next token is due and the rows of the step's
logits they read. This module builds their :class:`~attnlab.generation.sampler.RowSampling`
(EOS and ``stop_token_ids`` banned before ``min_tokens``), the grammar bitmask of the
constrained rows, and calls the sampler once for the batch. If the batch call raises
(a bug, or a fault in one request), every row is sampled again alone, so the rows that
work get their token and only the failing ones are reported, with the reason.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnlab.generation.sampler import RowSampling, SampleOutput, sample

__all__ = ["RowResult", "row_sampling", "sample_step"]

log = logging.getLogger(__name__)


@dataclass
class RowResult:
    """One sequence's outcome: a token (and its logprobs), or the reason it failed."""

    token: int = -1
    logprobs: tuple[float, list[tuple[int, float]]] | None = None
    error: str | None = None


def row_sampling(seq: Any, eos_ids: set[int], extra: Sequence[int] = ()) -> RowSampling:
    """The sampler's row of an engine sequence (EOS and ``stop_token_ids`` banned before
    ``min_tokens``), sampled as if ``extra`` (drafted tokens) were already output."""
    p = seq.request.params
    output_ids = list(seq.output_ids) + list(extra) if extra else seq.output_ids
    banned: list[int] = []
    if len(output_ids) < p.min_tokens:
        banned = sorted(eos_ids | set(p.stop_token_ids))
    return RowSampling(
        settings=p.settings,
        prompt_ids=seq.request.prompt_ids,
        output_ids=output_ids,
        banned=banned,
        generator=seq.generator,
    )


def _masks(seqs: Sequence[Any], rows: list[RowSampling], errors: dict[int, str]) -> Tensor | None:
    """The bitmask of the constrained rows (``rows[i].bitmask_row`` set), or None."""
    from attnlab.generation.grammar import fill_bitmask

    constrained = [i for i, s in enumerate(seqs) if getattr(s, "matcher", None) is not None]
    if not constrained:
        return None
    try:
        bitmask = fill_bitmask([seqs[i].matcher for i in constrained])
    except Exception:  # find the matcher at fault; the others keep their masks
        vocab = seqs[constrained[0]].matcher.vocab_size
        bitmask = torch.full((len(constrained), (vocab + 31) // 32), -1, dtype=torch.int32)
        for m, i in enumerate(constrained):
            try:
                seqs[i].matcher.fill(bitmask, m)
            except Exception as e:
                errors[i] = f"the grammar failed: {type(e).__name__}: {e}"
    for m, i in enumerate(constrained):
        rows[i].bitmask_row = m
    return bitmask


def _one(
    logits: Tensor, row: RowSampling, bitmask: Tensor | None, generator: torch.Generator
) -> SampleOutput:
    if row.bitmask_row is not None and bitmask is not None:
        bitmask = bitmask[row.bitmask_row : row.bitmask_row + 1]
        row = RowSampling(**{**row.__dict__, "bitmask_row": 0})
    return sample(logits[None], [row], bitmask=bitmask, generator=generator)


def sample_step(
    logits: Tensor,
    seqs: Sequence[Any],
    *,
    eos_ids: set[int],
    generator: torch.Generator,
    extras: Sequence[Sequence[int]] | None = None,
) -> list[RowResult]:
    """Choose the next token of each sequence.

    Args:
        logits: ``[B, V]``, row ``i`` for ``seqs[i]``.
        seqs: the engine's sequences (``request.params``, ``request.prompt_ids``,
            ``output_ids``, ``generator``, ``matcher``).
        eos_ids: the end-of-sequence tokens (banned before ``min_tokens``).
        generator: the noise of unseeded rows.
        extras: per row, the drafted tokens before its position (speculative
            verification: the row is sampled as if they were already output), or None.

    Returns:
        One :class:`RowResult` per sequence.
    """
    errors: dict[int, str] = {}
    rows = [row_sampling(s, eos_ids, extras[i] if extras else ()) for i, s in enumerate(seqs)]
    bitmask = _masks(seqs, rows, errors)
    try:
        out = sample(logits, rows, bitmask=bitmask, generator=generator)
        results = [RowResult(t, lp) for t, lp in zip(out.tokens, out.logprobs, strict=True)]
        for i, why in out.failed.items():
            results[i] = RowResult(error=why)
    except Exception:
        log.exception("batched sampling failed; sampling the %d rows one by one", len(rows))
        results = []
        for i, row in enumerate(rows):
            try:
                one = _one(logits[i], row, bitmask, generator)
            except Exception as e:
                results.append(RowResult(error=f"sampling failed: {type(e).__name__}: {e}"))
                continue
            results.append(
                RowResult(error=one.failed[0])
                if 0 in one.failed
                else RowResult(one.tokens[0], one.logprobs[0])
            )
    for i, why in errors.items():
        results[i] = RowResult(error=why)
    return results
