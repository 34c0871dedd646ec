"""Packing variable-length sequences into rows, and the length-sorted alternative.

An encoder that runs a padded batch spends its matmuls on padding: a batch of 32
sentences of 8 to 128 tokens, padded to 128, is about half padding. Packing puts the
real tokens of many sequences one after another in the same row, with

* a ``document`` pattern (:func:`attnlab.functional.masks.document`) so that a token
  attends only to the tokens of its own sequence (backends that skip blocks skip the
  cross-sequence ones), and
* positions that restart at 0 for every sequence,

so each sequence gets exactly the states it would get alone, while almost no compute
goes to padding (Krell et al., 2021, "Efficient sequence packing without
cross-contamination"). Rows are filled best-fit decreasing.

Bucketing is the simple alternative: sort by length and cut batches of neighbours, so
each batch pads only to its own longest member (what sentence-transformers does).

Shape notation: ``R`` rows, ``S`` row length, ``N`` sequences.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnlab.functional.masks import padding_mask
from attnlab.models.outputs import EncoderOutput

__all__ = [
    "TokenBatch",
    "bucket_batches",
    "forward_unpadded",
    "make_packed",
    "make_padded",
    "pack_rows",
    "packed_batches",
]


@dataclass(frozen=True)
class TokenBatch:
    """One forward's worth of sequences, laid out in rows.

    Attributes:
        input_ids: ``[R, S]`` token ids (``pad_id`` in empty slots).
        position_ids: ``[R, S]`` position of each token within its own sequence.
        document_ids: ``[R, S]`` which sequence of the row a slot holds (0, 1, ...),
            ``-1`` for an empty slot; None for a padded batch (one sequence per row).
        attention_mask: ``[R, S]`` of 1 (token) / 0 (empty slot).
        segments: ``[R * S]`` index of each slot's sequence in ``order``'s numbering
            (``0..len(order)-1``), ``-1`` for empty slots: what pooling reduces over.
        order: the caller's indices of the sequences in this batch.
        token_type_ids: ``[R, S]`` segment ids, or None (all zero).
    """

    input_ids: Tensor
    position_ids: Tensor
    document_ids: Tensor | None
    attention_mask: Tensor
    segments: Tensor
    order: list[int]
    token_type_ids: Tensor | None = None

    @property
    def slots(self) -> int:
        """Token slots computed (real tokens plus padding)."""
        return int(self.input_ids.numel())

    @property
    def real_tokens(self) -> int:
        return int(self.attention_mask.sum())


def pack_rows(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """Best-fit decreasing: indices of the sequences each row holds, each row's total ``<= row_len``.

    Args:
        lengths: tokens of each sequence, each in ``1..row_len``.
        row_len: slots per row.

    Raises:
        ValueError: a length outside ``1..row_len``.
    """
    if row_len < 1:
        raise ValueError(f"row_len must be >= 1, got {row_len}")
    bad = [(i, n) for i, n in enumerate(lengths) if not 1 <= n <= row_len]
    if bad:
        raise ValueError(f"sequence lengths must be in 1..{row_len}, got (index, length) {bad[:5]}")
    rows: list[list[int]] = []
    # free[c]: rows with exactly c free slots; a new item goes to the fullest row it fits.
    free: list[list[int]] = [[] for _ in range(row_len + 1)]
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        n = lengths[i]
        c = next((c for c in range(n, row_len + 1) if free[c]), None)
        if c is None:
            rows.append([i])
            r, c_new = len(rows) - 1, row_len - n
        else:
            r = free[c].pop()
            rows[r].append(i)
            c_new = c - n
        if c_new > 0:
            free[c_new].append(r)
    return rows


def bucket_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Sort by length (longest first) and cut batches of ``batch_size`` neighbours."""
    order = sorted(range(len(lengths)), key=lambda j: (-lengths[j], j))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def packed_batches(
    lengths: Sequence[int], row_len: int, tokens_per_batch: int
) -> list[list[list[int]]]:
    """Pack into rows, then group rows so that each forward holds about ``tokens_per_batch`` slots."""
    rows = pack_rows(lengths, row_len)
    per = max(1, tokens_per_batch // row_len)
    return [rows[i : i + per] for i in range(0, len(rows), per)]


def make_packed(
    sequences: Sequence[Sequence[int]], rows: list[list[int]], *, row_len: int, pad_id: int = 0
) -> TokenBatch:
    """Lay out ``rows`` (indices into ``sequences``) as one packed batch ``[R, row_len]``."""
    r_count = len(rows)
    ids = torch.full((r_count, row_len), pad_id, dtype=torch.long)
    pos = torch.zeros((r_count, row_len), dtype=torch.long)
    doc = torch.full((r_count, row_len), -1, dtype=torch.long)
    seg = torch.full((r_count, row_len), -1, dtype=torch.long)
    order: list[int] = []
    for r, members in enumerate(rows):
        start = 0
        for d, i in enumerate(members):
            toks = sequences[i]
            n = len(toks)
            ids[r, start : start + n] = torch.as_tensor(toks, dtype=torch.long)
            pos[r, start : start + n] = torch.arange(n)
            doc[r, start : start + n] = d
            seg[r, start : start + n] = len(order)
            order.append(i)
            start += n
    return TokenBatch(
        input_ids=ids,
        position_ids=pos,
        document_ids=doc,
        attention_mask=(doc >= 0).long(),
        segments=seg.flatten(),
        order=order,
    )


def make_padded(
    sequences: Sequence[Sequence[int]], members: list[int], *, pad_id: int = 0
) -> TokenBatch:
    """Lay out ``members`` (indices into ``sequences``) one per row, right-padded to the longest."""
    width = max(len(sequences[i]) for i in members)
    ids = torch.full((len(members), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(members), width), dtype=torch.long)
    for r, i in enumerate(members):
        n = len(sequences[i])
        ids[r, :n] = torch.as_tensor(sequences[i], dtype=torch.long)
        mask[r, :n] = 1
    rows = torch.arange(len(members)).unsqueeze(-1).expand(-1, width)  # [R, S]
    seg = torch.where(mask.bool(), rows, torch.full_like(rows, -1))
    pos = torch.arange(width).unsqueeze(0).expand(len(members), -1)
    return TokenBatch(
        input_ids=ids,
        position_ids=pos,
        document_ids=None,
        attention_mask=mask,
        segments=seg.flatten(),
        order=list(members),
    )


def padded_slots(lengths: Sequence[int], batch_size: int) -> int:
    """Slots a length-sorted bucketed run computes."""
    return sum(len(b) * max(lengths[i] for i in b) for b in bucket_batches(lengths, batch_size))


def rows_needed(lengths: Sequence[int], row_len: int) -> int:
    """Rows best-fit decreasing packing needs (a lower bound is ``ceil(sum / row_len)``)."""
    return len(pack_rows(lengths, row_len)) if lengths else 0


def ideal_rows(lengths: Sequence[int], row_len: int) -> int:
    return math.ceil(sum(lengths) / row_len)


def forward_unpadded(
    model: Any,
    input_ids: Tensor | None,
    attention_mask: Tensor | None,
    token_type_ids: Tensor | None,
    position_ids: Tensor | None,
    output_hidden_states: bool,
) -> EncoderOutput:
    """:meth:`EncoderModel.forward` with ``unpad=True``: the real tokens of a padded batch
    packed into rows (a ``document`` pattern, positions restarting per sequence), the
    states scattered back; padding positions hold zeros."""
    if input_ids is None or attention_mask is None:
        raise ValueError("unpad=True needs input_ids and attention_mask")
    if tuple(attention_mask.shape) != tuple(input_ids.shape) or input_ids.dim() != 2:
        raise ValueError(
            f"attention_mask {tuple(attention_mask.shape)} must match input_ids "
            f"{tuple(input_ids.shape)}, both (batch, seq_len)"
        )
    b, s = input_ids.shape
    keep = padding_mask(attention_mask)[:, 0, 0, :]  # [B, S]
    cols = torch.arange(s, device=input_ids.device).expand(b, s)
    pos = cols + model.first_position if position_ids is None else position_ids.expand(b, s)
    types = None if token_type_ids is None else token_type_ids.expand(b, s)
    lengths = keep.sum(-1).tolist()
    present = [r for r in range(b) if lengths[r] > 0]
    rows = pack_rows([lengths[r] for r in present], s)
    n_rows = len(rows)
    ids_p = torch.zeros(n_rows, s, dtype=input_ids.dtype, device=input_ids.device)
    pos_p = torch.zeros_like(ids_p)
    types_p = torch.zeros_like(ids_p)
    doc_p = torch.full_like(ids_p, -1)
    src_flat: list[Tensor] = []  # flat index into [B * S] of each packed slot
    dst_flat: list[Tensor] = []  # flat index into [R * S]
    for r, members in enumerate(rows):
        start = 0
        for d, j in enumerate(members):
            row = present[j]
            where = keep[row].nonzero().flatten()  # [n]
            n = where.numel()
            ids_p[r, start : start + n] = input_ids[row, where]
            pos_p[r, start : start + n] = pos[row, where]
            if types is not None:
                types_p[r, start : start + n] = types[row, where]
            doc_p[r, start : start + n] = d
            src_flat.append(row * s + where)
            dst_flat.append(r * s + start + torch.arange(n, device=where.device))
            start += n
    out = model.forward(
        input_ids=ids_p,
        token_type_ids=types_p if types is not None else None,
        position_ids=pos_p,
        output_hidden_states=output_hidden_states,
        document_ids=doc_p,
    )
    src = torch.cat(src_flat) if src_flat else cols.new_zeros(0)
    dst = torch.cat(dst_flat) if dst_flat else cols.new_zeros(0)

    def scatter(h: Tensor) -> Tensor:
        d = h.shape[-1]
        full = h.new_zeros(b * s, d)
        full[src] = h.reshape(-1, d)[dst]
        return full.view(b, s, d)  # [B, S, D]

    last = scatter(out.last_hidden_state)
    return EncoderOutput(
        last_hidden_state=last,
        pooler_output=model.pooler(last) if model.pooler is not None else None,
        hidden_states=(
            tuple(scatter(h) for h in out.hidden_states) if out.hidden_states is not None else None
        ),
    )
