"""Compiled decode buckets: decode-only serving steps through a forward compiled once per size.

Shape notation: ``n`` sequences of the step, ``B`` the bucket (``n <= B``), ``nb`` blocks
per table row (the longest context a sequence may reach), ``V`` vocabulary.

A decode step runs one token of each of ``n`` sequences. Eagerly, each of the model's
layers costs the same Python and dispatch work whatever ``n`` is (SmolLM2's 30 layers
spend more time there than in their matmuls at one stream). vLLM captures CUDA graphs of
the decode step at a set of batch sizes and pads a step up to the next one; this module
does the same with ``torch.compile``: the flat forward
(:func:`~attnlab.models.flat.decoder_forward_flat`) is compiled once per bucket size
``B`` over tensors of fixed shapes (token ids ``[B]``, positions ``[B]``, block tables
``[B, nb]``, the kernel's row metadata ``[B, 3]``, write slots ``[B]``), with the plans'
backend (the ``paged_kernel`` C++ op, opaque to the graph through its fake kernel)
chosen before tracing, so the graph has no break and no host sync. A step of ``n``
sequences runs in bucket ``B``: rows ``n..B-1`` are padding, whose one token writes its
key/value to the pool's scratch block (block ``N``, which the manager never hands out)
and attends to that key alone, so it never reads or writes a live sequence's KV.

Steps with a prompt chunk run in the compiled prompt step
(:mod:`attnlab.serving.step_buckets`); speculative drafts and decode steps of more
sequences than the largest bucket run eagerly. A model with recurrent layers, a quantized KV pool, a dtype or pattern the
kernel does not run, or a named backend other than ``paged_kernel`` is refused with the
reason (:func:`bucket_refusal`).

Inductor's compiled code is cached under ``~/.cache/attnlab/inductor`` (next to the
built kernels; ``TORCHINDUCTOR_CACHE_DIR`` overrides it), so a second server start
compiles faster.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from attnlab.backends import native
from attnlab.backends.linear_pack import static_rows
from attnlab.backends.plan import AttentionPlan, BlockTable, SequenceLayout, resolve
from attnlab.models.decoder import DecoderLM
from attnlab.models.flat import FlatBatch, decoder_forward_flat, flat_plans
from attnlab.models.inference import pack_model, packing_report

if TYPE_CHECKING:
    from attnlab.serving.runner import ModelRunner

__all__ = [
    "DEFAULT_SIZES",
    "DecodeBuckets",
    "bucket_refusal",
    "enable_for_serving",
    "parse_sizes",
    "use_inductor_cache",
]

log = logging.getLogger("attnlab.serving")

#: The bucket sizes by default (vLLM's CUDA-graph sizes start the same way).
DEFAULT_SIZES = (1, 2, 4, 8, 16, 32)


def parse_sizes(text: str) -> tuple[int, ...]:
    """``"1,2,4,8"`` -> ``(1, 2, 4, 8)``.

    Raises:
        ValueError: not a comma-separated list of positive ints.
    """
    try:
        sizes = tuple(sorted({int(p) for p in text.split(",") if p.strip()}))
    except ValueError:
        sizes = ()
    if not sizes or sizes[0] < 1:
        raise ValueError(
            f"decode buckets must be a comma-separated list of positive ints, got {text!r}"
        )
    return sizes


def use_inductor_cache() -> None:
    """Cache inductor's code under ``~/.cache/attnlab/inductor`` (next to the built
    kernels), unless ``TORCHINDUCTOR_CACHE_DIR`` says where."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(native.kernel_dir().parent / "inductor")


def _template_layout(size: int) -> SequenceLayout:
    lengths = [1] * size
    return SequenceLayout.from_lengths(lengths)


def bucket_refusal(runner: ModelRunner) -> str | None:
    """Why ``runner``'s model cannot run compiled decode buckets, or None."""
    model = runner.model
    if not isinstance(model, DecoderLM):
        return f"compiled buckets run attnlab decoders, got {type(model).__name__}"
    if runner.has_state:
        return (
            "the model has recurrent layers: their state slots are gathered and scattered "
            "per group of sequences in Python, which a fixed-shape graph does not hold"
        )
    if not runner.has_kv:
        return "the model has no attention layers"
    if runner.pool.storage.quantized:
        return f"the KV pool holds {runner.pool.storage.kv_dtype} levels, read by gathering"
    if model.training:
        return "the model is in training mode"
    if model.backend not in ("auto", "paged_kernel"):
        return f"the buckets run the paged_kernel backend; the model names {model.backend!r}"
    reason = native.paged_status()
    if reason is not None:
        return f"the paged_kernel backend is unavailable: {reason}"
    try:
        _Bucket(runner, 1, width=1, scratch=runner.pool.num_blocks)
    except ValueError as e:
        return str(e)
    return None


def kernel_plans(
    runner: ModelRunner, rows: int, *, width: int, scratch: int, what: str
) -> tuple[dict[str, tuple[int, ...]], SequenceLayout, dict[int | None, AttentionPlan]]:
    """The template of ``rows`` decode rows, each over a ``width``-block table of the
    scratch block, that a compiled step is traced with: the block tables' host metadata,
    the rows' layout, and the flat forward's plans (one per sliding window) with the
    ``paged_kernel`` backend chosen. Raises ValueError naming ``what`` when the kernel
    cannot run them."""
    model = runner.model
    assert isinstance(model, DecoderLM)
    bs = runner.manager.block_size
    zeros = (0,) * rows
    host = dict(lengths=(width * bs,) * rows, offsets=zeros, first_block=zeros)
    table = torch.full((rows, width), scratch, dtype=torch.long)
    meta = torch.tensor([[1, 0, 0]] * rows, dtype=torch.long)
    blocks = BlockTable(table=table, block_size=bs, meta=meta, **host)  # type: ignore[arg-type]
    layout = SequenceLayout.from_lengths([1] * rows, blocks=blocks)
    batch = FlatBatch(
        positions=torch.zeros(1, rows, dtype=torch.long),
        layout=layout,
        last=torch.arange(rows),
        blocks=blocks,
        write_slots=torch.zeros(rows, dtype=torch.long),
    )
    x = model._float_param().new_empty((1, rows, model.decoder_config.hidden_size))
    plans: dict[int | None, AttentionPlan] = {}
    for window, plan in flat_plans(model, x, batch, runner.cache).items():
        try:
            kernel = resolve(plan.call, "paged_kernel")
        except ValueError as e:
            raise ValueError(f"the paged_kernel backend cannot run {what}: {e}") from None
        plans[window] = replace(plan, backend=kernel, group_backends=())
    return host, layout, plans


class _Bucket:
    """One bucket size ``B``: its plans (backend chosen), its layout and its compiled step."""

    def __init__(self, runner: ModelRunner, size: int, *, width: int, scratch: int) -> None:
        model = runner.model
        assert isinstance(model, DecoderLM)
        self.model, self.cache, self.size = model, runner.cache, size
        bs = runner.manager.block_size
        self.block_size = bs
        self.layout = _template_layout(size)
        self.last = torch.arange(size)
        self.host, _, self.plans = kernel_plans(
            runner, size, width=width, scratch=scratch, what="the decode step"
        )
        self.step: Callable[..., Tensor] = torch.compile(self._forward, dynamic=False)
        self.seconds: float | None = None

    def _forward(
        self, ids: Tensor, positions: Tensor, table: Tensor, meta: Tensor, write: Tensor
    ) -> Tensor:
        """``ids [1, B]``, ``positions [1, B]``, ``table [B, nb]``, ``meta [B, 3]``,
        ``write [B]`` -> logits ``[B, V]``."""
        blocks = BlockTable(table=table, block_size=self.block_size, meta=meta, **self.host)  # type: ignore[arg-type]
        group = replace(self.layout.groups[0], blocks=blocks)
        layout = replace(self.layout, groups=(group,))
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
        batch = FlatBatch(positions=positions, layout=layout, last=self.last)
        return decoder_forward_flat(self.model, ids, batch, self.cache, plans)


class DecodeBuckets:
    """The compiled decode steps of a :class:`~attnlab.serving.runner.ModelRunner`.

    Args:
        runner: the runner whose decode-only steps run compiled.
        sizes: the bucket sizes ``B`` (a step of ``n`` sequences runs in the smallest
            ``B >= n``; more than the largest runs eagerly).
        max_model_len: the longest context a sequence may reach (the tables' width).
        pack: lay out the model's float linears for the bucket sizes first
            (:func:`attnlab.models.inference.pack_model`: each layer's kernel measured per
            size; the eager steps use them too).

    Raises:
        ValueError: sizes that are not positive ints, or a model the buckets cannot run
            (the reason, from :func:`bucket_refusal`).
    """

    def __init__(
        self,
        runner: ModelRunner,
        sizes: Sequence[int] = DEFAULT_SIZES,
        *,
        max_model_len: int,
        pack: bool = True,
    ) -> None:
        if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(f"decode bucket sizes must be positive ints, got {sizes!r}")
        reason = bucket_refusal(runner)
        if reason is not None:
            raise ValueError(f"compiled decode buckets refused: {reason}")
        use_inductor_cache()
        self.runner = runner
        self.sizes = tuple(sorted(set(sizes)))
        if pack:  # the float linears laid out for these row counts, before any tracing
            t = time.perf_counter()
            pack_model(runner.model, rows=self.sizes)
            report = packing_report(runner.model)["kernels"]
            log.info("packed linears in %.1f s: %s", time.perf_counter() - t, report)
        bs = runner.manager.block_size
        self.width = -(-max_model_len // bs)
        self.scratch = runner.pool.num_blocks  # the pool's spare block
        self._buckets = {
            s: _Bucket(runner, s, width=self.width, scratch=self.scratch) for s in self.sizes
        }
        self.steps = 0  # decode steps run compiled

    @property
    def compile_seconds(self) -> dict[int, float]:
        """Seconds each warmed bucket took to compile (its first run)."""
        return {s: b.seconds for s, b in self._buckets.items() if b.seconds is not None}

    def warm(self) -> float:
        """Compile every bucket now (a step of padding rows only: the scratch block is all
        it touches); returns the seconds it took."""
        t0 = time.perf_counter()
        for size, bucket in self._buckets.items():
            if bucket.seconds is None:
                t = time.perf_counter()
                self._call(bucket, [], [], [], [], [])
                bucket.seconds = time.perf_counter() - t
                log.info("compiled decode bucket %d in %.1f s", size, bucket.seconds)
        return time.perf_counter() - t0

    def run(self, rows: Sequence[tuple[object, int]]) -> Tensor | None:
        """Logits ``[n, V]`` of a decode-only step's rows, or None when the step does not
        fit a bucket (a row with more than one new token, or more rows than the largest
        bucket, or a context past the tables' width): the caller then runs it eagerly."""
        n = len(rows)
        if n > self.sizes[-1] or any(k != 1 for _, k in rows):
            return None
        size = next(s for s in self.sizes if s >= n)
        m, bs = self.runner.manager, self.runner.manager.block_size
        ids: list[int] = []
        pos: list[int] = []
        write: list[int] = []
        meta: list[list[int]] = []
        for sid, _ in rows:
            s = m._seq(sid)  # type: ignore[arg-type]
            p = s.computed
            if p + 1 > self.width * bs:
                return None
            ids.append(s.tokens[p])
            pos.append(p)
            write.append(s.blocks[p // bs] * bs + p % bs)
            meta.append([p + 1, 0, s.first_live])
        sids = [sid for sid, _ in rows]
        bucket = self._buckets[size]
        if bucket.seconds is None:
            t = time.perf_counter()
            out = self._call(bucket, sids, ids, pos, write, meta)
            bucket.seconds = time.perf_counter() - t
            log.info("compiled decode bucket %d in %.1f s (first step)", size, bucket.seconds)
        else:
            out = self._call(bucket, sids, ids, pos, write, meta)
        self.steps += 1
        return out[:n]

    # inference mode in warm-up as in the engine's step: tensors made under it carry other
    # dispatch keys, and dynamo's guard on them would compile every bucket a second time
    @torch.inference_mode()
    def _call(
        self,
        bucket: _Bucket,
        sids: list[object],
        ids: list[int],
        pos: list[int],
        write: list[int],
        meta: list[list[int]],
    ) -> Tensor:
        size, n, bs = bucket.size, len(ids), self.runner.manager.block_size
        pad = size - n
        table = torch.full((size, self.width), self.scratch, dtype=torch.long)
        if n:
            br = self.runner.block_rows
            rows = br.rows(sids)  # type: ignore[arg-type]
            held = min(br.table.shape[1], self.width)
            idx = torch.tensor(rows, dtype=torch.long)
            table[:n, :held] = br.table[:, :held].index_select(0, idx)

        def t(x: list[int]) -> Tensor:
            return torch.tensor(x, dtype=torch.long)

        ids_t = t(ids + [0] * pad)[None]
        pos_t = t(pos + [0] * pad)[None]
        write_t = t(write + [self.scratch * bs] * pad)
        meta_t = t([v for r in meta for v in r] + [1, 0, 0] * pad).view(size, 3)
        limit = max(8, 2 * len(self.sizes))  # past it, dynamo would run a bucket eagerly
        with torch._dynamo.config.patch(recompile_limit=limit), static_rows():
            return bucket.step(ids_t, pos_t, table, meta_t, write_t)


def enable_for_serving(
    engine: object, sizes: Sequence[int] | None, *, required: bool, prefill: bool = True
) -> str:
    """Compile ``engine``'s decode buckets now (a server's start), and its prompt steps
    (:mod:`attnlab.serving.step_buckets`: one graph for every step with prompt chunks,
    fresh or continuing, beside any number of decode rows), or say why not.

    Args:
        engine: a :class:`~attnlab.serving.Engine` (its ``runner`` and ``max_model_len``).
        sizes: the bucket sizes, or None (every step eager, prefill steps too).
        required: the user asked for the buckets: a refusal is an error (else it is
            logged and the server decodes eagerly).
        prefill: also compile the steps with prompt chunks.

    Returns:
        What the server's banner says about decoding.

    Raises:
        ValueError: ``required`` and the buckets are refused (the reason).
    """
    if not sizes:
        return "eager decode steps"
    runner: ModelRunner = engine.runner  # type: ignore[attr-defined]
    reason = bucket_refusal(runner)
    if reason is not None:
        if required:
            raise ValueError(f"--decode-buckets: compiled decode buckets refused: {reason}")
        log.info("compiled decode buckets refused: %s", reason)
        return f"eager decode steps (compiled buckets refused: {reason})"
    t = time.perf_counter()
    max_len: int = engine.max_model_len  # type: ignore[attr-defined]
    runner.compile_buckets(sizes, max_model_len=max_len)
    secs = time.perf_counter() - t
    listed = ",".join(map(str, sorted(set(sizes))))
    said = f"decode steps compiled at batch sizes {listed} (in {secs:.0f} s)"
    if not prefill:
        return said
    t = time.perf_counter()
    runner.compile_prefill(max_model_len=max_len)
    secs = time.perf_counter() - t
    return f"{said}; steps with prompts beside any decode rows (one graph, in {secs:.0f} s)"
