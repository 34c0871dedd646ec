"""What a server does between building its engine and saying it is ready.

* :func:`packing_lines`: the server log's account of the packed float linears (which
  kernel each shape runs at each row bucket, whether the decision was read from the
  choice file or measured now, and the memory the laid-out copies take), so two starts
  can be compared line by line (:mod:`attnlab.backends.gemm_cache`).
* :func:`warm_paths`: run requests through every path a step can take, so no first use
  (a compiled graph's first call at a new shape, an eager step's first oneDNN primitive,
  the sampler's first sampled row, the detokeniser) lands on a client's request.
* :func:`freeze_heap`: collect once, then move every object alive into the collector's
  permanent generation (``gc.freeze()``, as vLLM's engine core does after start-up):
  compiling leaves millions of objects behind, and a full collection walking them pauses
  the step that triggers it for tens to hundreds of milliseconds.
"""

from __future__ import annotations

import gc
import logging
import sys
import time
from dataclasses import replace
from typing import Any

__all__ = ["build_served_engine", "freeze_heap", "packing_lines", "warm_paths"]

log = logging.getLogger(__name__)


def packing_lines(model: Any, choices: Any = None) -> list[str]:
    """The packed linears of ``model`` as log lines: a summary, then one line per shape
    with each row bucket's kernel (``chosen/fewer rows`` where they differ; ``*``: read
    from the choice file). ``choices``: the :class:`~attnlab.backends.gemm_cache.ChoiceFile`
    the packing ran under, or None."""
    from attnlab.models.inference import packed_linears, packing_report

    packed = packed_linears(model)
    if not packed:
        return ["packed linears: none (the float linears run F.linear)"]
    report = packing_report(model)
    shapes: dict[tuple[int, int], list[str]] = {}
    for name, p in packed.items():
        shapes.setdefault((p.out_features, p.in_features), []).append(name)
    stored = measured = 0
    rows: list[str] = []
    for (n, k), names in sorted(shapes.items()):
        p = packed[names[0]]
        cells = []
        for b, c in sorted(p.choices.items()):
            stored += c.stored
            measured += c.how == "measured" and not c.stored
            kernel = c.chosen if c.other_rows == c.chosen else f"{c.chosen}/{c.other_rows}"
            cells.append(f"{b}:{kernel}{'*' if c.stored else ''}")
        rows.append(f"  [{n}, {k}] x{len(names)}: {' '.join(cells)}")
    where = f" in {choices.path}" if choices is not None else " (no choice file)"
    head = (
        f"packed linears: {len(packed)} layers, {report['extra_bytes'] / 2**20:.1f} MiB of "
        f"laid-out copies; per shape, rows:kernel ({stored} decisions read from the "
        f"file{where} (*), {measured} measured now)"
    )
    return [head, *rows]


def build_served_engine(
    model: Any,
    decode_sizes: tuple[int, ...] | None,
    decode_required: bool,
    prefill: bool = True,
    warm: bool = True,
    freeze: bool = True,
    **kwargs: Any,
) -> tuple[Any, str]:
    """``(engine, model name)`` as ``attnlab serve`` runs it: loaded, its decode buckets
    and prefill steps compiled (or the reason they are not, on stderr), its float
    linears' kernels read from or written to the choice file
    (:mod:`attnlab.backends.gemm_cache`) and logged, every step path warmed (``warm``)
    and the heap frozen out of the collector (``freeze``)."""
    from attnlab.backends.gemm_cache import persisted_choices
    from attnlab.serving.decode_buckets import enable_for_serving
    from attnlab.serving.server import load_engine

    with persisted_choices() as choices:
        engine, name = load_engine(model, **kwargs)
        said = [enable_for_serving(engine, decode_sizes, required=decode_required, prefill=prefill)]
        said += packing_lines(engine.model, choices)
        if warm:
            said.append(warm_paths(engine))
    if freeze:
        said.append(freeze_heap())
    print("\n".join(said), file=sys.stderr)
    sys.stderr.flush()
    return engine, name


def warm_paths(engine: Any, *, max_seconds: float = 120.0) -> str:
    """Run a few short requests through ``engine`` before it serves (bounded in count
    and in time), covering the paths a step can take: a prompt alone and beside
    decoding sequences, prompts batched together, a prompt longer than the step's token
    budget (chunked, so a continuing chunk runs), a prefix-cache hit, greedy and sampled
    rows, and every decode batch size up to the engine's decode buckets. Then the
    metrics are reset, so ``/metrics`` counts clients only. Returns what the banner says.
    """
    import random

    from attnlab.serving.metrics import EngineMetrics
    from attnlab.serving.params import SamplingParams

    t0 = time.perf_counter()
    rng = random.Random(0)
    vocab = int(engine.vocab_size)
    budget = int(engine.max_num_batched_tokens)
    # prompt + 16 new tokens fit the context, and half the pool holds a prompt
    cap = min(int(engine.max_model_len) - 20, engine.pool.num_blocks * engine.pool.block_size // 2)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(max(1, min(n, cap)))]

    buckets = getattr(engine.runner, "buckets", None)
    sizes = buckets.sizes if buckets is not None else (1, 8)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, top_k=40, seed=0,
                             ignore_eos=True)  # fmt: skip
    rounds: list[tuple[list[list[int]], list[SamplingParams]]] = []
    shared = prompt(64)
    rounds.append(([prompt(128)], [greedy]))  # a prompt alone, then 1-row decodes
    rounds.append(([prompt(128)], [sampled]))
    rounds.append(([prompt(128)], [SamplingParams(max_tokens=4, ignore_eos=True)]))  # defaults
    rounds.append(([shared + prompt(16), shared + prompt(16)], [greedy, greedy]))  # a prefix hit
    rounds.append(([prompt(budget + 40)], [greedy]))  # chunked: a continuing chunk
    for size in sizes:  # every decode bucket, with prompts joining running sequences
        n = max(1, min(size, int(engine.max_num_seqs)))
        ps = [prompt(rng.choice((16, 64, 128))) for _ in range(n)]
        long = [replace(p, max_tokens=16) for p in (greedy, sampled)]  # the rows overlap
        rounds.append((ps, [long[i % 2] for i in range(n)]))
    done = 0
    for prompts, params in rounds if cap >= 8 else []:
        if time.perf_counter() - t0 > max_seconds:
            break
        try:
            outs = engine.generate(prompts, params)
        except ValueError as e:  # a request this engine refuses (its context or pool)
            log.warning("a warm-up round was refused and skipped: %s", e)
            continue
        bad = [c.error for choices in outs for c in choices if c.finish_reason == "error"]
        if bad:  # the server still starts: a client's request on that path fails alone
            log.warning("a warm-up request failed: %s", bad[0])
        done += len(prompts)
    engine.metrics = EngineMetrics()
    engine.output.metrics = engine.metrics
    secs = time.perf_counter() - t0
    log.info("warmed the step paths with %d requests in %.1f s", done, secs)
    return f"step paths warmed with {done} requests in {secs:.1f} s"


def freeze_heap() -> str:
    """``gc.collect()`` then ``gc.freeze()``: the objects alive now are never scanned
    again. Returns what the banner says."""
    t = time.perf_counter()
    gc.collect()
    gc.freeze()
    return f"{gc.get_freeze_count()} objects frozen out of the collector in {time.perf_counter() - t:.1f} s"
