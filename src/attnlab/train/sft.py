"""Supervised fine-tuning batches: packed rows with the ``document`` pattern, or padding.

Shape notation: ``B`` rows, ``L`` tokens per row.

Two layouts of the same examples, both giving each example exactly the loss it has alone:

* **packed**: examples placed whole into rows of ``max_len`` tokens (first fit, longest
  first); each row carries document ids, so attention follows ``causal() & document(ids)``
  and positions restart at every example: no token sees another example, none is
  predicted across a boundary. The row's tail after its last example is padding, a
  document of its own with no targets.
* **padded**: batches of examples of similar length (grouped within windows of the epoch's
  order), right-padded to the longest and masked with ``attention_mask``.

:func:`choose_layout` asks the cost model (:func:`attnlab.analysis.cost.estimate`) what
an epoch costs in each layout and takes the cheaper; the run reports both and the
padding each computes.

Labels are the tokens themselves where the chat template says the assistant speaks and
``-100`` elsewhere (the decoder shifts them inside its loss).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from attnlab.functional.losses import IGNORE_INDEX
from attnlab.train.chat import ChatExample
from attnlab.train.data import Batch

__all__ = ["LayoutChoice", "SFTData", "choose_layout", "pack_examples"]

log = logging.getLogger(__name__)

LAYOUTS = ("auto", "packed", "padded")
_GROUP_WINDOW = 16  # length grouping sorts windows of this many batches


def pack_examples(lengths: list[int], max_len: int) -> list[list[int]]:
    """Example indices per row: first fit, longest first (each length ``<= max_len``)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        n = lengths[i]
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(max_len - n)
    return rows


def _counted(batch: Batch) -> Batch:
    """``batch`` with its target count (the decoder shifts labels left by one)."""
    return replace(batch, num_targets=int((batch.labels[:, 1:] != IGNORE_INDEX).sum()))


def _labels(ex: ChatExample) -> Tensor:
    ids = torch.tensor(ex.input_ids, dtype=torch.long)
    keep = torch.tensor(ex.assistant, dtype=torch.bool)
    labels = ids.masked_fill(~keep, IGNORE_INDEX)
    labels[0] = IGNORE_INDEX  # nothing before an example's first token predicts it
    return labels


def packed_batch(
    examples: list[ChatExample], rows: list[list[int]], max_len: int, pad: int
) -> Batch:
    """Rows of whole examples: ``input_ids``, ``labels``, ``doc_ids``, ``position_ids``."""
    b = len(rows)
    ids = torch.full((b, max_len), pad, dtype=torch.long)
    labels = torch.full((b, max_len), IGNORE_INDEX, dtype=torch.long)
    docs = torch.zeros((b, max_len), dtype=torch.long)
    pos = torch.zeros((b, max_len), dtype=torch.long)
    for r, members in enumerate(rows):
        at = 0
        for d, i in enumerate(members):
            ex = examples[i]
            n = len(ex)
            ids[r, at : at + n] = torch.tensor(ex.input_ids)
            labels[r, at : at + n] = _labels(ex)
            docs[r, at : at + n] = d
            pos[r, at : at + n] = torch.arange(n)
            at += n
        docs[r, at:] = len(members)  # the tail: a padding document of its own
        pos[r, at:] = torch.arange(max_len - at)
    return _counted(Batch(input_ids=ids, labels=labels, doc_ids=docs, position_ids=pos))


def padded_batch(examples: list[ChatExample], members: list[int], pad: int) -> Batch:
    """Examples right-padded to the longest: ``input_ids``, ``labels``, ``attention_mask``."""
    longest = max(len(examples[i]) for i in members)
    b = len(members)
    ids = torch.full((b, longest), pad, dtype=torch.long)
    labels = torch.full((b, longest), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((b, longest), dtype=torch.long)
    for r, i in enumerate(members):
        n = len(examples[i])
        ids[r, :n] = torch.tensor(examples[i].input_ids)
        labels[r, :n] = _labels(examples[i])
        mask[r, :n] = 1
    return _counted(Batch(input_ids=ids, labels=labels, attention_mask=mask))


@dataclass
class LayoutChoice:
    """What the cost model said of the two layouts for one epoch.

    Attributes:
        layout: ``"packed"`` or ``"padded"``.
        flops: estimated training FLOPs of an epoch, per layout.
        padding_share: share of the computed token slots that are padding, per layout.
        rows: rows (packed) or sequences (padded) per epoch, per layout.
        reason: one sentence for the run's log.
    """

    layout: str
    flops: dict[str, float] = field(default_factory=dict)
    padding_share: dict[str, float] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    reason: str = ""


def _group_order(lengths: list[int], batch_size: int, seed: int) -> list[int]:
    """A shuffled order whose runs of ``batch_size`` have similar lengths."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(lengths), generator=g).tolist()
    window = batch_size * _GROUP_WINDOW
    grouped: list[list[int]] = []
    for lo in range(0, len(order), window):
        chunk = sorted(order[lo : lo + window], key=lambda i: lengths[i])
        grouped += [chunk[k : k + batch_size] for k in range(0, len(chunk), batch_size)]
    perm = torch.randperm(len(grouped), generator=g).tolist()
    return [i for p in perm for i in grouped[p]]


def choose_layout(
    model: Any, lengths: list[int], *, max_len: int, batch_size: int, layout: str = "auto"
) -> LayoutChoice:
    """Cost one epoch of ``lengths`` packed and padded; pick the cheaper (or ``layout``).

    Raises:
        ValueError: an unknown layout.
    """
    from attnlab.analysis.cost import estimate, human_flops
    from attnlab.functional.masks import document

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
    real = sum(lengths)
    rows = pack_examples(lengths, max_len)
    # packed: each row costed with its document pattern (rows of one composition share it)
    packed = 0.0
    seen: dict[tuple[int, ...], float] = {}
    for members in rows:
        key = tuple(sorted(lengths[i] for i in members))
        if key not in seen:
            sizes = [*key, max_len - sum(key)] if sum(key) < max_len else list(key)
            doc = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))[None]
            seen[key] = estimate(
                model, batch_size=1, seq_len=max_len, mode="training", mask=document(doc)
            ).flops
        packed += seen[key]
    order = _group_order(lengths, batch_size, 0)
    padded, padded_slots = 0.0, 0
    for lo in range(0, len(order), batch_size):
        members = order[lo : lo + batch_size]
        longest = max(lengths[i] for i in members)
        padded += estimate(model, batch_size=len(members), seq_len=longest, mode="training").flops
        padded_slots += len(members) * longest
    flops = {"packed": packed, "padded": padded}
    share = {"packed": 1 - real / (len(rows) * max_len), "padded": 1 - real / padded_slots}
    best = min(flops, key=lambda k: flops[k])
    chosen = best if layout == "auto" else layout
    reason = (
        f"{chosen}: the cost model puts an epoch at {human_flops(packed)} packed "
        f"({len(rows)} rows of {max_len}, {share['packed']:.0%} padding) and "
        f"{human_flops(padded)} padded ({share['padded']:.0%} padding)"
        + ("" if layout == "auto" else f"; {layout} was asked for")
    )
    return LayoutChoice(
        layout=chosen,
        flops=flops,
        padding_share=share,
        rows={"packed": len(rows), "padded": len(lengths)},
        reason=reason,
    )


class SFTData:
    """Chat examples as training batches for :class:`~attnlab.train.trainer.Trainer`.

    Args:
        train, heldout: rendered examples (:func:`~attnlab.train.chat.encode_chat`).
        max_len: tokens per packed row; longer examples are cut to it (counted in
            :attr:`truncated`).
        layout: ``"packed"`` or ``"padded"``.
        batch_size: sequences per step (length grouping works in these).
        pad_token_id: the filler token.
        vocab_size: the model's vocabulary.
        seed: the order's seed.
        tokenizer: kept for export.

    Raises:
        ValueError: no training or held-out examples, an unknown layout, a bad max_len.
    """

    def __init__(
        self,
        train: list[ChatExample],
        heldout: list[ChatExample],
        *,
        max_len: int,
        layout: str,
        batch_size: int,
        pad_token_id: int,
        vocab_size: int,
        seed: int = 0,
        tokenizer: Any = None,
    ) -> None:
        if layout not in ("packed", "padded"):
            raise ValueError(f"layout must be 'packed' or 'padded', got {layout!r}")
        if not isinstance(max_len, int) or max_len < 2:
            raise ValueError(f"max_len must be an integer >= 2, got {max_len!r}")
        if not train or not heldout:
            raise ValueError(
                f"fine-tuning needs training and held-out examples, got {len(train)} and "
                f"{len(heldout)}"
            )
        self.truncated = sum(len(e) > max_len for e in train + heldout)
        if self.truncated:
            log.warning("%d examples longer than max_len=%d were cut", self.truncated, max_len)
        cut = [self._cut(e, max_len) for e in train], [self._cut(e, max_len) for e in heldout]
        self.train, self.heldout = cut
        self.max_len, self.layout, self.batch_size = max_len, layout, batch_size
        self.pad, self.vocab_size, self.seed = pad_token_id, vocab_size, seed
        self.tokenizer = tokenizer
        self.token_bytes: Tensor | None = None
        self._train_rows = pack_examples([len(e) for e in self.train], max_len)
        self._orders: dict[int, list[int]] = {}

    @staticmethod
    def _cut(e: ChatExample, n: int) -> ChatExample:
        return e if len(e) <= n else ChatExample(e.input_ids[:n], e.assistant[:n])

    @property
    def max_length(self) -> int:
        return self.max_len

    @property
    def units(self) -> int:
        """Samples in an epoch: packed rows, or examples."""
        return len(self._train_rows) if self.layout == "packed" else len(self.train)

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            seed = self.seed * 1_000_003 + epoch
            if self.layout == "packed":
                g = torch.Generator().manual_seed(seed)
                order = torch.randperm(len(self._train_rows), generator=g).tolist()
            else:
                order = _group_order([len(e) for e in self.train], self.batch_size, seed)
            self._orders = {epoch: order}
        return self._orders[epoch]

    def train_batch(self, start: int, count: int) -> Batch:
        """Samples ``[start, start + count)`` of the training stream (epochs repeat)."""
        n = self.units
        picks = [self._order(i // n)[i % n] for i in range(start, start + count)]
        if self.layout == "packed":
            return packed_batch(
                self.train, [self._train_rows[p] for p in picks], self.max_len, self.pad
            )
        return padded_batch(self.train, picks, self.pad)

    def eval_batches(self, count: int, batch_size: int) -> list[Batch]:
        """Held-out batches in a fixed order (all of them when ``count`` allows)."""
        out: list[Batch] = []
        if self.layout == "packed":
            rows = pack_examples([len(e) for e in self.heldout], self.max_len)
            for lo in range(0, len(rows), batch_size):
                out.append(
                    packed_batch(self.heldout, rows[lo : lo + batch_size], self.max_len, self.pad)
                )
        else:
            order = sorted(range(len(self.heldout)), key=lambda i: len(self.heldout[i]))
            for lo in range(0, len(order), batch_size):
                out.append(padded_batch(self.heldout, order[lo : lo + batch_size], self.pad))
        return out[:count]
