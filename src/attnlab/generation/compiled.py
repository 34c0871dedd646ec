"""The compiled decode step of ``generate``: when it runs, how it is built, what it cost.

``generate`` takes its fastest exact path by default (``compile=None``): the model's own
:meth:`~attnlab.models.decoder.DecoderLM.decode_step` compiled by ``torch.compile`` over
a :class:`~attnlab.cache.StaticKVCache` (fixed shapes, the slot as a tensor, no graph
break; gpt-fast's recipe, with no second copy of the forward) when
:func:`compile_decision` finds it possible and worth its cost, eagerly otherwise. The
first call for a new batch size or cache length compiles (10-20 s cold on 2 cores,
seconds with inductor's on-disk cache under ``$TMPDIR/torchinductor_<user>``); the time
is logged on the ``attnlab.generation`` logger and kept in :func:`compile_report`.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from attnlab.cache.base import KVCache
from attnlab.generation.inputs import check_cache_room, check_fresh_cache

__all__ = [
    "AUTO_COMPILE_MIN_NEW_TOKENS",
    "COMPILED_STEP_GRAPHS",
    "STATIC_BUCKET",
    "CompileDecision",
    "bucket_slots",
    "compile_decision",
    "compile_report",
    "compiled_decode_step",
    "keep_static_cache",
    "lay_out_linears",
    "release_static_cache",
    "static_cache",
    "warm_stance",
]

logger = logging.getLogger("attnlab.generation")

#: Static caches of compiled generation hold a multiple of this many slots.
STATIC_BUCKET = 128

#: ``compile=None`` compiles when a run asks for at least this many new tokens: below it
#: a cold compile (10-20 s) costs more than the eager steps it would save.
AUTO_COMPILE_MIN_NEW_TOKENS = 128

#: Decode-step graphs one process may compile (one per model, batch size and cache-length
#: bucket). dynamo's own limit (8) counts every graph of ``DecoderLM.decode_step``'s code
#: object, whichever model it belongs to, and ``fullgraph=True`` turns reaching it into a
#: crash on the ninth model or shape.
COMPILED_STEP_GRAPHS = 64

#: After a run's first compiled step has passed every guard, its later steps skip
#: dynamo's guard evaluation (:func:`warm_stance`). False: every step evaluates them all
#: (for A/B measurements; the same tokens either way).
SKIP_WARM_GUARDS = True


def bucket_slots(needed: int) -> int:
    """Slots of a compiled generation's static cache: ``needed`` rounded up to a bucket."""
    return -(-needed // STATIC_BUCKET) * STATIC_BUCKET


@dataclass(frozen=True)
class CompileDecision:
    """Whether a generation runs the compiled decode step, and why.

    Attributes:
        compile: run the compiled step.
        reason: the rule that decided (the first one that refused, or why it compiles).
    """

    compile: bool
    reason: str


def _refusal(model: nn.Module) -> str | None:
    """Why this model's decode step cannot be compiled, or None."""
    config: Any = getattr(model, "config", None)
    if getattr(model, "is_encoder_decoder", False) or not hasattr(model, "decode_step"):
        return (
            f"compile=True compiles a decoder-only model's decode step; {type(model).__name__} "
            "has none: use compile=False"
        )
    new_cache = getattr(model, "new_cache", None)
    if callable(new_cache) and not all(isinstance(c, KVCache) for c in new_cache().layers):
        return (
            "compile=True needs a static KV cache in every layer; "
            f"{type(model).__name__} has layers that carry a recurrent state: use compile=False"
        )
    rope_type = (getattr(config, "rope_scaling", None) or {}).get("rope_type")
    if rope_type in ("dynamic", "longrope"):
        return (
            "compile=True needs fixed RoPE frequencies; "
            + ("dynamic NTK" if rope_type == "dynamic" else "LongRoPE")
            + " scaling changes them with the length: use compile=False"
        )
    return None


def compiler_available() -> str | None:
    """Why ``torch.compile`` cannot build a CPU graph here (no dynamo, no C++ compiler), or None."""
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile is not supported on this Python"
    if not any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++")):
        return "no C++ compiler on PATH (inductor needs one for CPU graphs)"
    return None


def compile_decision(
    model: nn.Module,
    max_new_tokens: int,
    *,
    compile: bool | None = None,
    cache: Any = None,
    kv_dtype: str | None = None,
    eos_token_id: Any = None,
    batch_size: int = 1,
    prompt_length: int = 1,
) -> CompileDecision:
    """Whether ``generate(model, ..., compile=compile)`` runs the compiled decode step.

    ``compile=True`` or ``False`` is obeyed (True raises where it cannot run);
    ``compile=None`` compiles a decoder-only model in eval mode when nothing prevents it
    (no ``kv_dtype`` or user cache, fixed RoPE, a C++ compiler) and the compile is paid
    for: a graph of this shape (batch size, cache bucket) exists already, or the run has
    a known length (no ``eos_token_id``: with one, an answer may end after a few tokens)
    of at least :data:`AUTO_COMPILE_MIN_NEW_TOKENS` new tokens.

    Raises:
        ValueError: ``compile=True`` for a model whose step cannot be compiled.
    """
    if compile is False:
        return CompileDecision(False, "compile=False")
    refusal = _refusal(model)
    if compile:
        if refusal is not None:
            raise ValueError(refusal)
        return CompileDecision(True, "compile=True")
    if refusal is not None:
        return CompileDecision(False, refusal.replace("compile=True", "the compiled step", 1))
    if kv_dtype is not None:
        return CompileDecision(False, "a quantized KV cache (kv_dtype) decodes eagerly")
    if cache is not None:
        return CompileDecision(False, "a cache was passed: the eager loop uses it as it is")
    if getattr(model, "prefill_again_at", None) is not None:
        return CompileDecision(False, "LongRoPE re-encodes the sequence mid-run: eager")
    if model.training:
        return CompileDecision(False, "the model is in training mode (dropout): eager")
    why_not = compiler_available()
    if why_not is not None:
        return CompileDecision(False, why_not)
    shape = (batch_size, bucket_slots(prompt_length + max_new_tokens))
    if shape in model.__dict__.get("_compiled_shapes", ()):
        return CompileDecision(True, f"a graph for batch {shape[0]}, {shape[1]} slots exists")
    if eos_token_id is not None:
        return CompileDecision(
            False, "with eos_token_id the run may end early: a compile may not pay for itself"
        )
    if max_new_tokens < AUTO_COMPILE_MIN_NEW_TOKENS:
        return CompileDecision(
            False,
            f"{max_new_tokens} new tokens < {AUTO_COMPILE_MIN_NEW_TOKENS}: a compile would "
            "cost more than it saves",
        )
    return CompileDecision(
        True, f"{max_new_tokens} new tokens >= {AUTO_COMPILE_MIN_NEW_TOKENS} and compile available"
    )


@dataclass(frozen=True)
class CompileRecord:
    """One compile of the decode step: its shape and the seconds the first call took."""

    batch_size: int
    slots: int
    seconds: float


def compile_report(model: nn.Module) -> list[CompileRecord]:
    """The compiles of ``model``'s decode step in this process, oldest first."""
    return list(model.__dict__.get("_compile_records", []))


def compiled_decode_step(model: nn.Module) -> Any:
    """``torch.compile`` of ``model.decode_step``, made once per model and kept on it.

    The step has fixed shapes over a static cache and takes its slot as a tensor, so one
    graph serves every step of every generation with the same batch size and cache
    length (``dynamic=False``; ``fullgraph=True`` fails loudly on a graph break
    rather than running part of the step eagerly). Each shape's first call is timed
    (:func:`compile_report`). Up to :data:`COMPILED_STEP_GRAPHS`
    graphs are kept per process; past that, a clear ``RuntimeError``.
    """
    step = getattr(model, "_compiled_decode_step", None)
    if step is None:
        decode_step: Any = model.decode_step
        compiled = torch.compile(decode_step, fullgraph=True, dynamic=False)

        records: list[CompileRecord] = model.__dict__.setdefault("_compile_records", [])
        seen: set[tuple[int, int]] = model.__dict__.setdefault("_compiled_shapes", set())

        def step(*args: Any, **kwargs: Any) -> Any:
            cache = kwargs["cache"]
            shape = (int(args[0].shape[0]), int(cache.layers[0].max_length))
            t0 = time.perf_counter()
            with torch._dynamo.config.patch(recompile_limit=COMPILED_STEP_GRAPHS):
                try:
                    out = compiled(*args, **kwargs)
                except torch._dynamo.exc.FailOnRecompileLimitHit as err:
                    raise RuntimeError(
                        f"generate(compile=True) has compiled {COMPILED_STEP_GRAPHS} decode-step "
                        "graphs in this process (one per model, batch size and cache length); "
                        "use compile=False, or fewer distinct shapes"
                    ) from err
            if shape not in seen:  # the first call of a shape compiles: report it
                seen.add(shape)
                records.append(CompileRecord(shape[0], shape[1], time.perf_counter() - t0))
                logger.info(
                    "compiled %s's decode step for batch %d, %d cache slots in %.1f s",
                    type(model).__name__, shape[0], shape[1], records[-1].seconds,
                )  # fmt: skip
            return out

        model.__dict__["_compiled_decode_step"] = step
    return step


@contextlib.contextmanager
def warm_stance(warm: bool) -> Iterator[None]:
    """The compiled decode step's guards: all of them (``warm=False``, a run's first
    step), or only those that tell the compiled graphs apart (a later step of the same
    run; ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``).

    A SmolLM2 step carries ~8,000 guards (every parameter and buffer of 30 layers, the
    cache's tensors, their dimension markings), measured 2.4-3.4 ms a step on 2 cores:
    as much as the step's attention. Within one run they cannot change: the same model
    and cache objects, the same shapes and dtypes (the token ``[B, 1]``, the whole
    mask, the slot a 0-d tensor), grad mode fixed by ``stream``'s ``no_grad``, and the
    read prefix a dynamic size bounded below the cache's length (its range is the
    graph's). What does change between runs (another model, batch size, cache bucket,
    dtype, a module swapped, a layout re-packed) is caught by the next run's first
    step, which evaluates every guard and recompiles. The stance is entered around the
    call only, never across ``stream``'s yields to the caller's code.
    """
    if not (warm and SKIP_WARM_GUARDS):
        yield
        return
    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
        yield


def lay_out_linears(model: nn.Module, batch_size: int) -> None:
    """Lay out ``model``'s float linears (and a tied head) for decode steps of
    ``batch_size`` rows, once per row bucket, before the step is traced.

    The decode step multiplies a few rows by every weight; ``F.linear``'s GEMM against
    the transposed weight is slow at those shapes (the round-one benchmark's
    ``[8, 256] x [256, 32000]`` head: 3.3 ms, against 1.6 ms with the weight stored
    transposed), so the compiled step runs
    :func:`attnlab.models.inference.pack_model`'s kernels, chosen per shape by
    measurement (float32 sums either way: the same tokens up to rounding ties). The
    model is changed in place (same parameters and state dict; a laid-out copy of a
    weight where a kernel reads one: ``packing_report(model)["extra_bytes"]``);
    ``attnlab.models.inference.unpack_model(model)`` undoes it. A new row bucket packs
    the model again (its other compiled graphs then recompile once); a model the user
    packed (or unpacked) for these rows is left as it is, as are quantized and non-CPU
    layers.
    """
    from attnlab.backends.linear_pack import MAX_ROWS, row_bucket
    from attnlab.models.inference import pack_model, packed_linears, packing_report

    bucket = row_bucket(batch_size)
    if bucket > MAX_ROWS or model.training:
        return  # GEMM-shaped rows: F.linear by rule; training: the plain layers
    tried: set[int] = model.__dict__.setdefault("_packed_rows", set())
    packed = packed_linears(model)
    if bucket in tried or (packed and all(bucket in p.rows for p in packed.values())):
        return  # done before (or by the user, for these rows)
    tried.add(bucket)
    rows = tried.union(*(p.rows for p in packed.values()))
    t0 = time.perf_counter()
    pack_model(model, rows=sorted(rows))
    report = packing_report(model)
    if not report["kernels"]:
        return  # nothing to lay out (quantized layers, another device)
    logger.info(
        "laid out %s's linears for %s-row steps in %.1f s: %s (%.0f MB of copies)",
        type(model).__name__, sorted(rows), time.perf_counter() - t0, report["kernels"],
        report["extra_bytes"] / 1e6,
    )  # fmt: skip


def static_cache(model: nn.Module, cache: Any, b: int, needed: int) -> Any:
    """The static cache of a compiled generation: a new one, or the user's, checked."""
    refusal = _refusal(model)
    if refusal is not None:
        raise ValueError(refusal)
    if cache is None:
        # Lengths rounded up to a bucket: one compiled graph serves many prompt lengths
        # (the causal pattern hides the slots beyond the current one).
        bucket = bucket_slots(needed)
        kept = model.__dict__.pop("_static_cache", None)  # taken: not shared while in use
        if kept is not None and _fits(model, kept, b, bucket):
            kept.reset()  # lengths only: the buffers keep the last call's (finite) keys
            return kept
        return model.new_cache(kind="static", max_length=bucket, batch_size=b)  # type: ignore[operator]
    check_fresh_cache(cache)
    from attnlab.cache import StaticKVCache

    if not all(isinstance(c, StaticKVCache) for c in getattr(cache, "layers", [])):
        raise ValueError(
            "compile=True needs static caches (model.new_cache(kind='static', ...)), got "
            f"{sorted({type(c).__name__ for c in cache.layers})}"
        )
    check_cache_room(cache, needed)
    return cache


def keep_static_cache(model: nn.Module, cache: Any) -> None:
    """Keep the static cache of a generation that ended normally for the next call.

    :func:`static_cache` hands it out again, unzeroed, when batch size, slots, dtype and
    device fit (one cache per model: the last one). That is exact: a step reads every
    slot, but the causal pattern (and the padding mask) give each slot that this call
    has not written zero weight, and a slot left by an earlier call holds the finite
    keys and values that call wrote (a call that failed, or a stream stopped early,
    does not give its cache back). Zeroing the buffers at each call cost ~10% of a
    short SmolLM2 decode. ``release_static_cache(model)`` frees it.
    """
    model.__dict__["_static_cache"] = cache


def release_static_cache(model: nn.Module) -> None:
    """Free the static cache :func:`keep_static_cache` kept on ``model`` (if any)."""
    model.__dict__.pop("_static_cache", None)


def _fits(model: nn.Module, cache: Any, b: int, slots: int) -> bool:
    """Whether a kept static cache serves a generation of ``b`` rows over ``slots`` slots."""
    from attnlab.cache import StaticKVCache

    param = model._float_param()  # type: ignore[operator]
    layers = getattr(cache, "layers", [])
    expected = len(model.new_cache().layers)  # type: ignore[operator]
    return len(layers) == expected and all(
        isinstance(c, StaticKVCache)
        and c.k is not None
        and c.max_length == slots
        and c.k.shape[0] == b
        and c.k.dtype == param.dtype
        and c.k.device == param.device
        for c in layers
    )
