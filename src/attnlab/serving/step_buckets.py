"""Compiled prompt steps: serving steps that carry prompt chunks (new prompts, prefix hits,
second chunks) beside any number of decode rows, through one graph with both dynamic.

Shape notation: ``D`` decode rows of the step (padded to at least :data:`MIN_ROWS`),
``C`` chunks, ``Q`` chunk tiles (each chunk cut into tiles of :data:`TILE` queries, its
last tile padded; at least :data:`MIN_ROWS` tiles), ``N = D + Q * TILE`` tokens of the
flat row, ``R`` logits rows, ``nb`` blocks per table row, ``V`` vocabulary.

A step that admits a request runs its prompt (a chunk of it) beside one token of every
decoding sequence. Eagerly, each of the model's layers pays the same Python and
dispatch work for it as for a decode step, plus unfused element-wise work over the
chunk's tokens (norms, RoPE, the gated activation). vLLM compiles its forward once with
the step's token count symbolic and runs attention as an opaque op over the step's
metadata; this module does the same for attnlab's flat forward
(:func:`~attnlab.models.flat.decoder_forward_flat`), in one graph whose decode-row count
``D`` and tile count ``Q`` are both symbolic:

- the row is ``[D decode tokens | Q tiles of TILE chunk tokens]``;
- every token's key/value is written to its pool slot first (padding to the pool's
  scratch block, which the manager never hands out), then the attention reads the pool
  in place through the ``paged_kernel`` op, as two groups of kernel rows: the decode
  rows (one query each, over their sequence's blocks) and the tiles (``TILE`` queries
  each, over their chunk's sequence's blocks up to the tile's last query, causal on
  positions). A chunk's queries so see the keys computed before it (a prefix-cache hit,
  the first chunks of a chunked prefill) and its own earlier keys alike, so fresh and
  continuing chunks run the same graph, and ``TILE`` is the kernel's own query tile
  (one kernel task per tile row, as the eager call of a chunk runs);
- padding decode rows read the scratch block's first slot; a padding query of a tile
  repeats its tile's last position (its logits are never read).

Steps with speculative drafts, decode-only steps (the decode buckets run those,
:mod:`attnlab.serving.decode_buckets`) and contexts past the tables' width run
otherwise. The models refused are those the decode buckets refuse
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

__all__ = ["MIN_ROWS", "TILE", "PromptSteps"]

log = logging.getLogger("attnlab.serving")

#: Queries per kernel row of a chunk (``csrc/paged_attention.cpp``'s query tile).
TILE = 16
#: The fewest decode rows, tiles and logits rows a step is padded to: dynamo
#: specialises sizes 0 and 1, so a smaller step would trace another graph.
MIN_ROWS = 2


class _PromptGraph:
    """The compiled prompt step: its plans (backend chosen) and its graph."""

    def __init__(self, runner: ModelRunner, *, width: int, scratch: int) -> None:
        model = runner.model
        assert isinstance(model, DecoderLM)
        self.model, self.cache = model, runner.cache
        self.block_size = runner.manager.block_size
        from attnlab.serving.decode_buckets import kernel_plans

        self.host, self.template, self.plans = kernel_plans(
            runner, MIN_ROWS, width=width, scratch=scratch, what="the prompt steps"
        )
        self.step: Callable[..., Tensor] = torch.compile(self._forward)
        self.seconds: float | None = None

    def _forward(
        self,
        dec: Tensor,
        dec_table: Tensor,
        dec_meta: Tensor,
        tiles: Tensor,
        tile_table: Tensor,
        tile_meta: Tensor,
        last: Tensor,
    ) -> Tensor:
        """``dec [3, D]`` (ids, positions, write slots), ``dec_table [D, nb]``,
        ``dec_meta [D, 3]``, ``tiles [3, Q, TILE]``, ``tile_table [Q, nb]``,
        ``tile_meta [Q, 3]``, ``last [R]`` -> logits ``[R, V]``."""
        d, q = dec.shape[1], tiles.shape[1]
        n = d + q * TILE
        flat = torch.cat([dec, tiles.reshape(3, q * TILE)], dim=1)  # [3, N]
        ids, positions, write = flat[0:1], flat[1:2], flat[2]
        host, bs = self.host, self.block_size
        dec_blocks = BlockTable(table=dec_table, block_size=bs, meta=dec_meta, **host)  # type: ignore[arg-type]
        tile_blocks = BlockTable(table=tile_table, block_size=bs, meta=tile_meta, **host)  # type: ignore[arg-type]
        di, ti = torch.arange(d), torch.arange(d, n)
        groups = (  # rows () : their count is symbolic (len(spread) // width)
            SeqGroup((), 1, di, di, di, dec_blocks),
            SeqGroup((), TILE, ti, ti, torch.arange(n - d), tile_blocks),
        )
        layout = replace(self.template, groups=groups)
        plans = {
            w: replace(
                p,
                positions=positions,
                q_positions=positions,
                layout=layout,
                blocks=dec_blocks,
                write_slots=write,
            )
            for w, p in self.plans.items()
        }
        batch = FlatBatch(positions=positions, layout=layout, last=last)
        return decoder_forward_flat(self.model, ids, batch, self.cache, plans)


class PromptSteps:
    """The compiled prompt steps of a :class:`~attnlab.serving.runner.ModelRunner`: one
    graph for every step that carries prompt chunks beside decode rows.

    Args:
        runner: the runner whose steps with prompt chunks run compiled.
        max_model_len: the longest context a sequence may reach (the tables' width).

    Raises:
        ValueError: a model the graph cannot run (the reason).
    """

    def __init__(self, runner: ModelRunner, *, max_model_len: int) -> None:
        from attnlab.serving.decode_buckets import bucket_refusal, use_inductor_cache

        if not isinstance(max_model_len, int) or max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive int, got {max_model_len!r}")
        reason = bucket_refusal(runner)
        if reason is not None:
            raise ValueError(f"compiled prompt steps refused: {reason}")
        use_inductor_cache()
        self.runner = runner
        bs = runner.manager.block_size
        self.width = -(-max_model_len // bs)
        self.scratch = runner.pool.num_blocks  # the pool's spare block
        self.graph = _PromptGraph(runner, width=self.width, scratch=self.scratch)
        self.steps = 0  # steps run compiled

    @property
    def compile_seconds(self) -> float | None:
        """Seconds the graph took to compile (its first run), or None before."""
        return self.graph.seconds

    def warm(self) -> float:
        """Compile the graph now (padding only: the scratch block is all it touches);
        returns the seconds it took."""
        t0 = time.perf_counter()
        if self.graph.seconds is None:  # sizes apart: dynamo gives equal sizes one symbol
            self._call([], [[], [], []], [], [], [[], [], []], [], sizes=(2, 3, 4))
            self.graph.seconds = time.perf_counter() - t0
            log.info("compiled the prompt step in %.1f s", self.graph.seconds)
        return time.perf_counter() - t0

    def run(self, rows: Sequence[tuple[object, int]]) -> Tensor | None:
        """Logits ``[n, V]`` of a step's rows, or None when the step is not one this
        graph runs (no prompt chunk, a context past the tables' width): the caller then
        runs it otherwise."""
        m, bs = self.runner.manager, self.runner.manager.block_size
        top = self.width * bs
        decode: list[tuple[object, int]] = []  # (seq_id, position)
        chunks: list[tuple[object, int, int]] = []  # (seq_id, first position, tokens)
        for sid, n in rows:
            c = m._seq(sid).computed  # type: ignore[arg-type]
            if c + n > top:
                return None
            if n == 1 and c > 0:
                decode.append((sid, c))
            else:
                chunks.append((sid, c, n))
        if not chunks:
            return None
        d = max(len(decode), MIN_ROWS)
        dec: list[list[int]] = [[], [], []]  # ids, positions, write slots
        dec_meta: list[list[int]] = []
        for sid, p in decode:
            s = m._seq(sid)  # type: ignore[arg-type]
            for col, v in zip(dec, (s.tokens[p], p, s.blocks[p // bs] * bs + p % bs)):
                col.append(v)
            dec_meta.append([p + 1, 0, s.first_live])
        tiles: list[list[int]] = [[], [], []]
        tile_meta: list[list[int]] = []
        tile_sids: list[object] = []
        ends: dict[object, int] = {}
        scratch = self.scratch * bs
        for sid, c, n in chunks:
            s = m._seq(sid)  # type: ignore[arg-type]
            for lo in range(c, c + n, TILE):
                hi = min(lo + TILE, c + n)  # the tile's real queries: positions lo..hi-1
                for i in range(TILE):
                    p = lo + i
                    real = p < hi
                    tiles[0].append(s.tokens[p] if real else 0)
                    tiles[1].append(p if real else hi - 1)
                    tiles[2].append(s.blocks[p // bs] * bs + p % bs if real else scratch + i % bs)
                tile_meta.append([hi, 0, s.first_live])
                tile_sids.append(sid)
            ends[sid] = d + len(tiles[0]) - TILE + (c + n - 1 - lo)
        where = {sid: i for i, (sid, _) in enumerate(decode)}
        last = [where[sid] if sid in where else ends[sid] for sid, _ in rows]
        sids = [sid for sid, _ in decode]
        out = self._call(sids, dec, dec_meta, tile_sids, tiles, tile_meta, last)
        self.steps += 1
        return out[: len(rows)]

    def _table(self, sids: list[object], rows: int) -> Tensor:
        """``[rows, nb]`` block-table rows of ``sids`` (the scratch block past them)."""
        table = torch.full((rows, self.width), self.scratch, dtype=torch.long)
        if sids:
            br = self.runner.block_rows
            idx = torch.tensor(br.rows(sids), dtype=torch.long)  # type: ignore[arg-type]
            held = min(br.table.shape[1], self.width)
            table[: len(sids), :held] = br.table[:, :held].index_select(0, idx)
        return table

    @torch.inference_mode()  # as the engine's step (see decode_buckets._call)
    def _call(
        self,
        sids: list[object],
        dec: list[list[int]],
        dec_meta: list[list[int]],
        tile_sids: list[object],
        tiles: list[list[int]],
        tile_meta: list[list[int]],
        last: Sequence[int] = (),
        sizes: tuple[int, int, int] = (MIN_ROWS, MIN_ROWS, MIN_ROWS),
    ) -> Tensor:
        """The graph's call over the step's host lists, padded to at least ``sizes``
        (decode rows, tiles, logits rows)."""
        scratch = self.scratch * self.runner.manager.block_size
        d, q = max(len(sids), sizes[0]), max(len(tile_sids), sizes[1])
        pad_d, pad_q = d - len(sids), (q - len(tile_sids)) * TILE
        dec_t = torch.tensor(
            [dec[0] + [0] * pad_d, dec[1] + [0] * pad_d, dec[2] + [scratch] * pad_d],
            dtype=torch.long,
        )  # [3, D]
        tiles_t = torch.tensor(
            [tiles[0] + [0] * pad_q, tiles[1] + [0] * pad_q, tiles[2] + [scratch] * pad_q],
            dtype=torch.long,
        ).view(3, q, TILE)
        pads = [[1, 0, 0]] * (d - len(sids))
        dec_meta_t = torch.tensor(dec_meta + pads, dtype=torch.long).view(d, 3)
        pads = [[1, 0, 0]] * (q - len(tile_sids))
        tile_meta_t = torch.tensor(tile_meta + pads, dtype=torch.long).view(q, 3)
        last_t = torch.tensor(list(last) + [0] * (sizes[2] - len(last)), dtype=torch.long)
        dec_table, tile_table = self._table(sids, d), self._table(tile_sids, q)
        for x, dim in (
            (dec_t, 1),
            (dec_table, 0),
            (dec_meta_t, 0),
            (tiles_t, 1),
            (tile_table, 0),
            (tile_meta_t, 0),
            (last_t, 0),
        ):
            torch._dynamo.maybe_mark_dynamic(x, dim)
        return self.graph.step(
            dec_t, dec_table, dec_meta_t, tiles_t, tile_table, tile_meta_t, last_t
        )
