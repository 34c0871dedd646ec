"""Sentence embeddings from an encoder: tokenize, pack or bucket, run, pool, normalise.

:meth:`attnlab.models.EncoderModel.encode` (and :func:`attnlab.embed`) call
:func:`encode` here. It reproduces sentence-transformers' ``encode`` (Reimers &
Gurevych, 2019) for the pooling and normalisation a model folder declares
(:class:`SentenceSettings`), and spends no compute on padding when it can:

* ``packed``: the real tokens of many texts share a row, with a ``document`` pattern
  and positions restarting per text (:mod:`attnlab.models.packing`);
* ``padded``: texts sorted by length and cut into batches of ``batch_size``, each padded
  to its longest text (sentence-transformers' own strategy).

``strategy="auto"`` takes the one the cost model (:func:`plan`) estimates cheaper, and
the :class:`EncodeReport` says which ran and why.

Shape notation: ``N`` texts, ``D`` embedding width, ``R`` rows, ``S`` row length.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from attnlab.functional._checks import check_int, check_positive_int
from attnlab.functional.pooling import normalize as l2_normalize
from attnlab.functional.pooling import pool_segments
from attnlab.models.packing import (
    TokenBatch,
    bucket_batches,
    make_packed,
    make_padded,
    pack_rows,
)

if TYPE_CHECKING:
    from attnlab.models.encoder import EncoderModel

__all__ = ["POOLING_MODES", "EncodePlan", "EncodeReport", "SentenceSettings", "encode", "plan"]

log = logging.getLogger(__name__)

#: Pooling modes attnlab implements, in the order sentence-transformers concatenates them.
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len")
STRATEGIES = ("auto", "packed", "padded")

#: Cost model constants (CPU, float32): sustained matmul rate and per-layer call overhead.
#: Only the ratio of the two plans' estimates matters to the choice.
MATMUL_FLOPS_PER_S = 1.5e11
LAYER_OVERHEAD_S = 3e-4


@dataclass(frozen=True)
class SentenceSettings:
    """How a model turns token states into sentence embeddings.

    Attributes:
        pooling: pooling modes, concatenated in this order (each from :data:`POOLING_MODES`).
        normalize: L2-normalise the pooled vector.
        max_seq_length: tokens per text after truncation ([CLS] and [SEP] included), or
            None for the model's position limit.
        source: where the settings came from (a pooling config's path, or why mean
            pooling was assumed); shown in reports.
    """

    pooling: tuple[str, ...] = ("mean",)
    normalize: bool = False
    max_seq_length: int | None = None
    source: str = "no sentence-transformers config: mean pooling, not normalised"

    def __post_init__(self) -> None:
        if not self.pooling:
            raise ValueError("pooling must name at least one mode")
        bad = [m for m in self.pooling if m not in POOLING_MODES]
        if bad:
            raise ValueError(f"unknown pooling mode(s) {bad}; attnlab implements {POOLING_MODES}")
        if self.max_seq_length is not None:
            check_int("max_seq_length", self.max_seq_length, min_value=2)


@dataclass(frozen=True)
class EncodePlan:
    """How a set of sequences will be laid out, and what the cost model expects it to cost.

    Attributes:
        strategy: ``"packed"`` or ``"padded"``.
        batches: per forward, the rows (packed: lists of sequence indices per row) or the
            sequence indices (padded: one per row).
        slots: token slots computed (real tokens plus padding).
        attention_pairs: (query, key) pairs per head and layer, summed over rows.
        seconds: the cost model's estimate.
        row_len: slots per row (packed); 0 for padded.
    """

    strategy: str
    batches: list[Any]
    slots: int
    attention_pairs: int
    seconds: float
    row_len: int = 0


@dataclass
class EncodeReport:
    """What :func:`encode` did: strategy and why, truncation, pooling, attention backend.

    Attributes:
        strategy: the layout that ran (``"packed"`` or ``"padded"``).
        reason: the cost model's comparison (or "requested").
        sequences: texts encoded.
        real_tokens: their tokens after truncation.
        slots: token slots computed (real + padding).
        alternative_slots: slots the other strategy would have computed.
        truncated: texts cut at ``max_seq_length``.
        max_seq_length: the truncation length used.
        pooling: pooling modes; ``normalize``: whether vectors were L2-normalised.
        pooling_source: where the pooling settings came from.
        attention: the attention backend ``auto`` chose for the first forward, and why.
        dtype: compute dtype.
    """

    strategy: str
    reason: str
    sequences: int = 0
    real_tokens: int = 0
    slots: int = 0
    alternative_slots: int = 0
    truncated: int = 0
    max_seq_length: int = 0
    pooling: tuple[str, ...] = ("mean",)
    normalize: bool = False
    pooling_source: str = ""
    attention: str = ""
    dtype: str = "float32"
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        share = self.real_tokens / max(1, self.slots)
        lines = [
            f"{self.sequences} texts, {self.real_tokens:,} tokens; {self.strategy}: "
            f"{self.slots:,} slots computed ({share:.0%} real tokens); {self.reason}",
            f"pooling: {'+'.join(self.pooling)}{', normalised' if self.normalize else ''} "
            f"({self.pooling_source}); dtype {self.dtype}",
        ]
        if self.truncated:
            lines.append(
                f"{self.truncated} text(s) longer than max_seq_length={self.max_seq_length} "
                "tokens were truncated"
            )
        if self.attention:
            lines.append(f"attention: {self.attention}")
        lines += self.notes
        return "\n".join(lines)


# ----------------------------------------------------------------------------- cost model


def _layer_flops_per_token(model: EncoderModel) -> float:
    c = model.config
    d, inter = c.hidden_size, c.intermediate_size
    kv = c.num_key_value_heads or c.num_attention_heads
    qkvo = 2 * d * d + 2 * d * (kv * c.head_dim)
    return 2.0 * (qkvo + 2 * d * inter)


def _estimate(model: EncoderModel, slots: int, pairs: int, forwards: int) -> float:
    c = model.config
    per_layer = slots * _layer_flops_per_token(model) + pairs * 4.0 * c.hidden_size
    return c.num_hidden_layers * (per_layer / MATMUL_FLOPS_PER_S + forwards * LAYER_OVERHEAD_S)


def plan(
    model: EncoderModel, lengths: Sequence[int], *, batch_size: int, strategy: str = "auto"
) -> tuple[EncodePlan, EncodePlan | None]:
    """Lay out sequences of ``lengths`` for the forwards, packed or padded.

    Packed rows are as long as the longest sequence; a forward takes about
    ``batch_size`` sequences' worth of real tokens. The estimate counts the matmul
    FLOPs of the layers over every slot computed, the attention pairs of every row
    (``S^2`` per row: the bound for a dense-mask kernel), and a small overhead per
    forward and layer.

    Returns:
        ``(chosen, other)``: the plan that runs and, under ``"auto"``, the alternative.
    """
    n = len(lengths)
    padded_batches = bucket_batches(lengths, batch_size)
    p_slots = sum(len(b) * max(lengths[i] for i in b) for b in padded_batches)
    p_pairs = sum(len(b) * max(lengths[i] for i in b) ** 2 for b in padded_batches)
    padded = EncodePlan(
        "padded",
        padded_batches,
        p_slots,
        p_pairs,
        _estimate(model, p_slots, p_pairs, len(padded_batches)),
    )
    if strategy == "padded" or n == 0:
        return padded, None
    row_len = max(lengths)
    rows = pack_rows(lengths, row_len)
    real = sum(lengths)
    per = max(1, round(batch_size * (real / n) / row_len))
    packed_groups = [rows[i : i + per] for i in range(0, len(rows), per)]
    k_slots = len(rows) * row_len
    k_pairs = len(rows) * row_len * row_len
    packed = EncodePlan(
        "packed",
        packed_groups,
        k_slots,
        k_pairs,
        _estimate(model, k_slots, k_pairs, len(packed_groups)),
        row_len=row_len,
    )
    if strategy == "packed":
        return packed, None
    # Ties go to padding: the simpler layout, no pattern.
    return (packed, padded) if packed.seconds < padded.seconds else (padded, packed)


# ----------------------------------------------------------------------------- inputs


def _tokenize(tokenizer: Any, texts: list[str], max_len: int) -> tuple[list[list[int]], list[int]]:
    """Token ids of each text truncated to ``max_len`` (as transformers' ``truncation=True``),
    and the indices of the texts that were cut."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not hasattr(backend, "encode_batch"):
        raise TypeError(
            "tokenizer must be a tokenizers.Tokenizer or a transformers fast tokenizer, got "
            f"{type(tokenizer).__name__}"
        )
    saved_trunc, saved_pad = backend.truncation, backend.padding
    backend.no_padding()
    backend.enable_truncation(max_len)
    try:
        encodings = backend.encode_batch(texts)
    finally:
        if saved_trunc is None:
            backend.no_truncation()
        else:
            backend.enable_truncation(**saved_trunc)
        if saved_pad is not None:
            backend.enable_padding(**{k: v for k, v in saved_pad.items() if k != "length"})
    ids = [list(e.ids) for e in encodings]
    cut = [i for i, e in enumerate(encodings) if e.overflowing]
    return ids, cut


def _as_sequences(
    inputs: Any, tokenizer: Any, max_len: int, vocab: int
) -> tuple[list[list[int]], list[int], bool]:
    """``(token ids per input, truncated indices, single)`` from texts or token ids."""
    single = isinstance(inputs, str)
    if single:
        inputs = [inputs]
    if isinstance(inputs, Tensor):
        if inputs.dim() != 2 or inputs.dtype.is_floating_point or inputs.dtype == torch.bool:
            raise ValueError(
                f"token ids must be an integer tensor (N, S), got {inputs.dtype} "
                f"{tuple(inputs.shape)}"
            )
        inputs = inputs.tolist()
    if not isinstance(inputs, Sequence):
        raise TypeError(
            f"inputs must be a string, a list of strings or a list of token-id lists, got "
            f"{type(inputs).__name__}"
        )
    items = list(inputs)
    if not items:
        return [], [], single
    if isinstance(items[0], str):
        odd = next((i for i, x in enumerate(items) if not isinstance(x, str)), None)
        if odd is not None:
            raise TypeError(
                f"inputs must be all strings or all lists of token ids; item {odd} is "
                f"{type(items[odd]).__name__}: {str(items[odd])[:40]!r}"
            )
        if tokenizer is None:
            raise ValueError(
                "texts need a tokenizer: load the model from a folder with attnlab.from_hf "
                "(it reads tokenizer.json), or pass tokenizer="
            )
        ids, cut = _tokenize(tokenizer, items, max_len)
        return ids, cut, single
    for i, x in enumerate(items):
        if isinstance(x, bytes | bytearray):  # a Sequence of ints, but not token ids
            raise TypeError(
                f"inputs: item {i} is {type(x).__name__} ({bytes(x)[:40]!r}); pass text as str "
                "(decode it first) or token ids as a list of ints"
            )
        ok = isinstance(x, Sequence | Tensor) and not isinstance(x, str)
        if ok and isinstance(x, Tensor):
            x = x.tolist()
            items[i] = x
        if not ok or not all(isinstance(t, int) and not isinstance(t, bool) for t in x):
            raise TypeError(
                f"inputs must be all strings or all lists of token ids; item {i} is "
                f"{type(x).__name__}: {str(x)[:40]!r}"
            )
        if not 1 <= len(x) <= max_len:
            raise ValueError(
                f"token-id list {i} has {len(x)} ids; each needs 1..{max_len} "
                "(max_seq_length; texts are truncated, ids are not)"
            )
        lo, hi = min(x), max(x)
        if lo < 0 or hi >= vocab:
            raise ValueError(f"token-id list {i} has ids in [{lo}, {hi}], outside [0, {vocab})")
    return [list(x) for x in items], [], single


# ----------------------------------------------------------------------------- encode


def _progress(items: list[Any], show: bool | None) -> Iterator[Any]:
    if show is None:
        show = len(items) > 8 and sys.stderr.isatty()
    if not show:
        yield from items
        return
    try:
        from tqdm.auto import tqdm
    except ImportError:
        n = len(items)
        for i, item in enumerate(items, 1):
            yield item
            print(f"\rencoding: {i}/{n} batches", end="\n" if i == n else "", file=sys.stderr)
        return
    yield from tqdm(items, desc="encoding", unit="batch")


def _run(model: EncoderModel, batch: TokenBatch) -> Tensor:
    if batch.document_ids is not None:
        out = model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids + model.first_position,  # RoBERTa's from pad + 1
            document_ids=batch.document_ids,
        )
    else:
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    h = out.last_hidden_state  # [R, S, D]
    return h.reshape(-1, h.shape[-1])  # [R*S, D]


def _attention_choice(model: EncoderModel, batch: TokenBatch, dtype: torch.dtype) -> str:
    from attnlab.backends import explain
    from attnlab.functional.masks import document, padding

    c = model.config
    r, s = batch.input_ids.shape
    q = torch.empty((), dtype=dtype).expand(r, c.num_attention_heads, s, c.head_dim)
    if batch.document_ids is not None:
        mask: Any = document(batch.document_ids)
    elif bool(batch.attention_mask.all()):
        mask = None
    else:
        mask = padding(batch.attention_mask)
    attention = getattr(model.layers[0], "attention", None) if len(model.layers) else None
    backend = getattr(attention, "backend", "auto")
    e = explain(q, q, q, mask, backend=backend if isinstance(backend, str) else "auto")
    return f"{e.chosen} ({e.reasons.get(e.chosen, '')})"


def encode(
    model: EncoderModel,
    inputs: Any,
    *,
    tokenizer: Any = None,
    settings: SentenceSettings | None = None,
    batch_size: int = 32,
    strategy: str = "auto",
    dtype: torch.dtype = torch.float32,
    normalize: bool | None = None,
    show_progress_bar: bool | None = None,
    return_report: bool = False,
) -> Tensor | tuple[Tensor, EncodeReport]:
    """Embed texts (or token-id lists); see :meth:`attnlab.models.EncoderModel.encode`."""
    from attnlab.models.encoder import EncoderModel

    if not isinstance(model, EncoderModel):
        raise TypeError(f"model must be an EncoderModel, got {type(model).__name__}")
    check_positive_int("batch_size", batch_size)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    settings = settings or model.sentence_settings or SentenceSettings()
    if not isinstance(settings, SentenceSettings):
        raise TypeError(f"settings must be a SentenceSettings, got {type(settings).__name__}")
    if settings.source.startswith("no ") and model.sentence_settings is None:
        log.info("%s", settings.source)
    limit = model.config.max_position_embeddings
    max_len = min(settings.max_seq_length or limit, limit)
    tokenizer = tokenizer if tokenizer is not None else model.tokenizer
    seqs, cut, single = _as_sequences(inputs, tokenizer, max_len, model.config.vocab_size)
    if normalize is not None and not isinstance(normalize, bool):
        raise TypeError(
            f"normalize must be True, False or None (the model's setting), got {normalize!r}"
        )
    do_norm = settings.normalize if normalize is None else normalize
    width = model.config.hidden_size * len(settings.pooling)
    report = EncodeReport(
        strategy="padded",
        reason="nothing to encode",
        sequences=len(seqs),
        truncated=len(cut),
        max_seq_length=max_len,
        pooling=settings.pooling,
        normalize=do_norm,
        pooling_source=settings.source,
        dtype=str(dtype).removeprefix("torch."),
    )
    if cut:
        log.warning(
            "%d of %d texts exceed max_seq_length=%d tokens and were truncated",
            len(cut),
            len(seqs),
            max_len,
        )
    device = next(model.parameters()).device
    if not seqs:
        empty = torch.zeros(0, width)
        return (empty, report) if return_report else empty
    lengths = [len(s) for s in seqs]
    chosen, other = plan(model, lengths, batch_size=batch_size, strategy=strategy)
    report.strategy = chosen.strategy
    report.real_tokens = sum(lengths)
    report.slots = chosen.slots
    if other is not None:
        report.alternative_slots = other.slots
        report.reason = (
            f"cost model: {chosen.strategy} ~{chosen.seconds * 1e3:.0f} ms vs {other.strategy} "
            f"~{other.seconds * 1e3:.0f} ms ({other.slots:,} slots)"
        )
    else:
        report.reason = "requested" if strategy != "auto" else "a single layout fits"
    pad_id = model.config.pad_token_id or 0
    out = torch.zeros(len(seqs), width)
    if chosen.strategy == "packed":
        batches = [
            make_packed(seqs, rows, row_len=chosen.row_len, pad_id=pad_id)
            for rows in chosen.batches
        ]
    else:
        batches = [make_padded(seqs, members, pad_id=pad_id) for members in chosen.batches]
    report.attention = _attention_choice(model, batches[0], dtype)
    autocast = (
        torch.autocast(device_type=device.type, dtype=torch.bfloat16)
        if dtype == torch.bfloat16
        else contextlib.nullcontext()
    )
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), autocast:
            for batch in _progress(batches, show_progress_bar):
                moved = TokenBatch(
                    input_ids=batch.input_ids.to(device),
                    position_ids=batch.position_ids.to(device),
                    document_ids=None
                    if batch.document_ids is None
                    else batch.document_ids.to(device),
                    attention_mask=batch.attention_mask.to(device),
                    segments=batch.segments,
                    order=batch.order,
                )
                h = _run(model, moved).float().cpu()  # [R*S, D]
                pooled = pool_segments(h, batch.segments, len(batch.order), settings.pooling)
                out[torch.as_tensor(batch.order)] = pooled
    finally:
        model.train(was_training)
    if do_norm:
        out = l2_normalize(out)
    result = out[0] if single else out
    return (result, report) if return_report else result
