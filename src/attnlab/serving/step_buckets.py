"""Compiled prefill steps: serving steps that carry fresh prefill chunks, compiled once per
decode-row bucket with the step's token count dynamic.

Shape notation: ``D`` decode rows of the step, ``D_b`` its row bucket (``D <= D_b``),
``T`` prefill tokens (padded up to a multiple of :data:`ALIGN`), ``N = D_b + T`` tokens
of the flat row, ``C`` chunks, ``R = D_b + max_chunks`` logits rows, ``nb`` blocks per
table row, ``V`` vocabulary.

A step that admits a request runs its prompt (a chunk of it) beside one token of every
decoding sequence. Eagerly, each of the model's layers pays the same Python and
dispatch work for it as for a decode step, plus unfused element-wise work over the
chunk's tokens (norms, RoPE, the gated activation). vLLM compiles its forward once with
the step's token count symbolic and runs attention as an opaque op over the step's
metadata; this module does the same for attnlab's flat forward
(:func:`~attnlab.models.flat.decoder_forward_flat`), one graph per decode-row bucket
``D_b`` (default 0 and 8):

- the row is ``[D_b decode tokens | T chunk tokens]``; ``N`` is marked dynamic, so one
  graph runs every chunk length up to the step's token budget (no token bucket to pad
  to beyond :data:`ALIGN`);
- the decode rows read the paged pool through the ``paged_kernel`` op (with the row
  metadata as tensors, as :mod:`attnlab.serving.decode_buckets` does); padding rows
  write to and read the pool's scratch block;
- the chunks are *fresh* (no token of their sequence computed before: a new prompt with
  no prefix-cache hit), so their keys are the step's new keys: one group
  (:class:`~attnlab.backends.plan.SeqGroup` with ``segments``) attends them through
  torch's kernel under a block-diagonal mask (each chunk sees its own keys, with the
  model's causal or sliding-window pattern on positions); their keys and values still go
  to their pool slots for the decode steps after. Padding tokens write to the scratch
  block and see only each other.

Steps whose chunks are not fresh (a prefix-cache hit, the second chunk of a chunked
prefill), with speculative drafts, more decode rows than the largest bucket, more than
``max_chunks`` chunks or more tokens than ``max_tokens`` run eagerly (or, decode-only,
in the decode buckets). The models refused are those the decode buckets refuse
(:func:`~attnlab.serving.decode_buckets.bucket_refusal`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from attnlab.backends.plan import BlockTable, SeqGroup
from attnlab.models.decoder import DecoderLM
from attnlab.models.flat import FlatBatch, decoder_forward_flat

if TYPE_CHECKING:
    from attnlab.serving.runner import ModelRunner

__all__ = ["ALIGN", "DEFAULT_ROWS", "PrefillBuckets"]

log = logging.getLogger("attnlab.serving")

#: The decode-row buckets of compiled prefill steps by default: a prompt alone, and
#: beside up to 8 decoding sequences (beside 9-32, four prompts of 128 tokens measured
#: no faster compiled, and each graph costs minutes of startup on a 30-layer model).
DEFAULT_ROWS = (0, 8)
#: Chunk tokens are padded up to a multiple of this (bounds the shapes the graph sees).
ALIGN = 16


class _PrefillBucket:
    """One decode-row bucket ``D_b``: its plans (backend chosen) and its compiled step."""

    def __init__(
        self, runner: ModelRunner, rows: int, *, width: int, scratch: int, max_chunks: int
    ) -> None:
        model = runner.model
        assert isinstance(model, DecoderLM)
        self.model, self.cache, self.rows = model, runner.cache, rows
        bs = runner.manager.block_size
        self.block_size = bs
        d = max(rows, 1)  # the kernel's template call (no decode row: never called)
        from attnlab.serving.decode_buckets import kernel_plans

        self.host, self.template, self.plans = kernel_plans(
            runner, d, width=width, scratch=scratch, what="the decode rows"
        )
        self.decode_index = torch.arange(rows)
        self.logits_rows = rows + max_chunks
        self.step: Callable[..., Tensor] = torch.compile(self._forward)
        self.seconds: float | None = None

    def _forward(
        self,
        ids: Tensor,
        positions: Tensor,
        table: Tensor,
        meta: Tensor,
        write: Tensor,
        segments: Tensor,
        last: Tensor,
    ) -> Tensor:
        """``ids [1, N]``, ``positions [1, N]``, ``table [D_b|1, nb]``, ``meta [D_b|1, 3]``,
        ``write [N]``, ``segments [N]`` (each chunk token's chunk, ``-1`` padding),
        ``last [R]`` -> logits ``[R, V]``."""
        n, d = ids.shape[1], self.rows
        blocks = BlockTable(table=table, block_size=self.block_size, meta=meta, **self.host)  # type: ignore[arg-type]
        groups: list[SeqGroup] = []
        if d:
            di = self.decode_index
            groups.append(SeqGroup(tuple(range(d)), 1, di, di, di, blocks))
        ci = torch.arange(d, n)
        groups.append(
            SeqGroup((d,), n - d, ci, ci, torch.arange(n - d), None, segments=segments[d:])
        )
        layout = replace(self.template, groups=tuple(groups))
        plans = {
            w: replace(
                p,
                positions=positions,
                q_positions=positions,
                layout=layout,
                blocks=blocks,
                write_slots=write,
            )
            for w, p in self.plans.items()
        }
        batch = FlatBatch(positions=positions, layout=layout, last=last)
        return decoder_forward_flat(self.model, ids, batch, self.cache, plans)


class PrefillBuckets:
    """The compiled prefill steps of a :class:`~attnlab.serving.runner.ModelRunner`.

    Args:
        runner: the runner whose steps with fresh prefill chunks run compiled.
        rows: the decode-row buckets ``D_b`` (a step of ``D`` decode rows runs in the
            smallest ``D_b >= D``; more than the largest runs eagerly).
        max_model_len: the longest context a sequence may reach (the tables' width).
        max_tokens: the most chunk tokens a compiled step takes (the step's budget).
        max_chunks: the most chunks a compiled step takes.

    Raises:
        ValueError: rows that are not ints >= 0, a bound below 1, or a model the buckets
            cannot run (the reason).
    """

    def __init__(
        self,
        runner: ModelRunner,
        rows: Sequence[int] = DEFAULT_ROWS,
        *,
        max_model_len: int,
        max_tokens: int,
        max_chunks: int = 4,
    ) -> None:
        from attnlab.serving.decode_buckets import bucket_refusal, use_inductor_cache

        if not rows or any(not isinstance(r, int) or r < 0 for r in rows):
            raise ValueError(f"prefill bucket rows must be ints >= 0, got {rows!r}")
        for name, value in (("max_tokens", max_tokens), ("max_chunks", max_chunks)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        reason = bucket_refusal(runner)
        if reason is not None:
            raise ValueError(f"compiled prefill steps refused: {reason}")
        use_inductor_cache()
        self.runner = runner
        self.rows = tuple(sorted(set(rows)))
        bs = runner.manager.block_size
        self.width = -(-max_model_len // bs)
        self.max_tokens = -(-max_tokens // ALIGN) * ALIGN
        self.max_chunks = max_chunks
        self.scratch = runner.pool.num_blocks  # the pool's spare block
        self._buckets = {
            r: _PrefillBucket(
                runner, r, width=self.width, scratch=self.scratch, max_chunks=max_chunks
            )
            for r in self.rows
        }
        self.steps = 0  # steps run compiled

    @property
    def compile_seconds(self) -> dict[int, float]:
        """Seconds each warmed bucket took to compile (its first run)."""
        return {r: b.seconds for r, b in self._buckets.items() if b.seconds is not None}

    def warm(self) -> float:
        """Compile every bucket now (padding only: the scratch block is all it touches);
        returns the seconds it took."""
        t0 = time.perf_counter()
        for rows, bucket in self._buckets.items():
            if bucket.seconds is None:
                t = time.perf_counter()
                self._call(bucket, [], [], [], [], [], 2 * ALIGN)
                bucket.seconds = time.perf_counter() - t
                log.info("compiled prefill step, %d decode rows, in %.1f s", rows, bucket.seconds)
        return time.perf_counter() - t0

    def run(self, rows: Sequence[tuple[object, int]]) -> Tensor | None:
        """Logits ``[n, V]`` of a step's rows, or None when the step is not one these
        graphs run (no fresh chunk, a chunk that is not fresh, too many rows, chunks or
        tokens, a context past the tables' width): the caller then runs it otherwise."""
        m, bs = self.runner.manager, self.runner.manager.block_size
        decode: list[tuple[object, int]] = []  # (seq_id, position)
        chunks: list[tuple[object, int]] = []  # (seq_id, tokens)
        for sid, n in rows:
            s = m._seq(sid)  # type: ignore[arg-type]
            if s.computed == 0:
                chunks.append((sid, n))
            elif n == 1:
                decode.append((sid, s.computed))
            else:
                return None  # a chunk after computed tokens: its keys are in the pool
        tokens = sum(n for _, n in chunks)
        if (
            not chunks
            or len(decode) > self.rows[-1]
            or len(chunks) > self.max_chunks
            or tokens > self.max_tokens
            or any(p + 1 > self.width * bs for _, p in decode)
            or any(n > self.width * bs for _, n in chunks)
        ):
            return None
        size = next(r for r in self.rows if r >= len(decode))
        ids: list[int] = []
        pos: list[int] = []
        write: list[int] = []
        meta: list[list[int]] = []
        for sid, p in decode:
            s = m._seq(sid)  # type: ignore[arg-type]
            ids.append(s.tokens[p])
            pos.append(p)
            write.append(s.blocks[p // bs] * bs + p % bs)
            meta.append([p + 1, 0, s.first_live])
        segs: list[int] = []
        ends: dict[object, int] = {}
        for c, (sid, n) in enumerate(chunks):
            s = m._seq(sid)  # type: ignore[arg-type]
            ids += s.tokens[:n]
            pos += range(n)
            write += [s.blocks[p // bs] * bs + p % bs for p in range(n)]
            segs += [c] * n
            ends[sid] = size + len(segs) - 1
        where = {sid: i for i, (sid, _) in enumerate(decode)}
        last = [where[sid] if sid in where else ends[sid] for sid, _ in rows]
        bucket = self._buckets[size]
        sids = [sid for sid, _ in decode]
        padded = -(-tokens // ALIGN) * ALIGN
        out = self._call(bucket, sids, ids, pos, write, meta, padded, segs, last)
        self.steps += 1
        return out[: len(rows)]

    @torch.inference_mode()  # as the engine's step (see decode_buckets._call)
    def _call(
        self,
        bucket: _PrefillBucket,
        sids: list[object],
        ids: list[int],
        pos: list[int],
        write: list[int],
        meta: list[list[int]],
        tokens: int,
        segs: Sequence[int] = (),
        last: Sequence[int] = (),
    ) -> Tensor:
        size, bs, d = bucket.rows, self.runner.manager.block_size, len(sids)
        rows = max(size, 1)
        table = torch.full((rows, self.width), self.scratch, dtype=torch.long)
        if d:
            br = self.runner.block_rows
            held = min(br.table.shape[1], self.width)
            idx = torch.tensor(br.rows(sids), dtype=torch.long)  # type: ignore[arg-type]
            table[:d, :held] = br.table[:, :held].index_select(0, idx)
        pad_d, pad_c = size - d, tokens - len(segs)
        scratch = self.scratch * bs

        def t(x: Sequence[int]) -> Tensor:
            return torch.tensor(list(x), dtype=torch.long)

        dec_ids, chunk_ids = ids[:d], ids[d:]
        dec_pos, chunk_pos = pos[:d], pos[d:]
        ids_t = t(dec_ids + [0] * pad_d + chunk_ids + [0] * pad_c)[None]
        pos_t = t(dec_pos + [0] * pad_d + chunk_pos + [0] * pad_c)[None]
        write_t = t(
            write[:d] + [scratch] * pad_d + write[d:] + [scratch + i % bs for i in range(pad_c)]
        )
        meta_t = t([v for r in meta for v in r] + [1, 0, 0] * (rows - d)).view(rows, 3)
        seg_t = t([-2] * size + list(segs) + [-1] * pad_c)
        last_t = t(list(last) + [0] * (bucket.logits_rows - len(last)))
        for x, dim in ((ids_t, 1), (pos_t, 1), (write_t, 0), (seg_t, 0)):
            torch._dynamo.maybe_mark_dynamic(x, dim)
        limit = max(8, 2 * len(self.rows))
        with torch._dynamo.config.patch(recompile_limit=limit):
            return bucket.step(ids_t, pos_t, table, meta_t, write_t, seg_t, last_t)
