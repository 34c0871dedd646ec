"""An advisor that chooses attention settings with the cost model, and says why in numbers.

The tutorial's selection guide (section 10) is the starting point: standard attention for
short-text classification, sparse or sliding-window attention for long documents, MQA/GQA
for real-time inference, a window of 512, linear attention when memory is low. Each rule
here is checked against :func:`~attnlab.analysis.cost.estimate` for the user's length,
memory and latency; where the numbers disagree with the rule of thumb, the numbers win and
the reason says so.

Speeds: on ``cpu`` the advisor uses figures measured on the project's machine (2 cores,
torch 2.13, float32; ``shared/NOTES.md``): about 175 GFLOP/s for float32 matmuls and 400
for bfloat16, and for the backend it asks ``auto``'s cost model, whose per-backend
constants were measured there (:mod:`attnlab.backends.cost_constants`): the registry's
ranking, as data, on every device. Decoding is costed per generated
token as its FLOPs plus reading the weights and the KV cache at :data:`CPU_GBPS`
(assumed). On ``cuda`` it assumes :data:`CUDA_TFLOPS` at 40% utilisation and
:data:`CUDA_GBPS` (stated in the reasons: no measurement backs them).
"""

from __future__ import annotations

from typing import Any

from attnlab._validate import check_positive_int, check_real
from attnlab.analysis.advice_plan import (
    GIB,
    Advice,
    Plan,
    Recommendation,
    calibrated_backend_rec,
    gib,
    plan,
)
from attnlab.analysis.advice_recurrent import state_space_recommendation
from attnlab.analysis.advice_rules import kv_heads_rule
from attnlab.analysis.advice_topics import (
    Search,
    attention_recs,
    checkpointing_rec,
    dtype_rec,
    latency_rec,
    positions_rec,
)
from attnlab.analysis.arch import ArchSpec, describe, preset
from attnlab.analysis.cost import dtype_bytes

__all__ = ["TASKS", "Advice", "Recommendation", "advise"]

TASKS = ("classification", "long-document", "generation", "realtime")


def _base_for(task: str) -> ArchSpec:
    if task in ("classification", "long-document"):
        return preset("tutorial")
    # a GPT-2-small-sized decoder with RoPE: the generation base
    return preset("gpt2").with_(
        name="decoder (GPT-2 small sizes)", position="rope", learned_positions=False
    )


def advise(
    task: str,
    *,
    seq_len: int,
    memory_gb: float,
    latency_ms: float | None = None,
    device: str = "cpu",
    batch_size: int = 1,
    base: Any = None,
    mode: str | None = None,
) -> Advice:
    """Recommend attention variant, backend, positions, KV heads, window, dtype, checkpointing.

    Args:
        task: ``classification``, ``long-document``, ``generation`` or ``realtime``.
        seq_len: tokens per sequence (generation: prompt + generated tokens).
        memory_gb: memory budget in GiB (the whole job: weights, optimizer, activations, cache).
        latency_ms: a latency budget for one forward (encoders) or one prefill (decoders).
        device: ``cpu`` or ``cuda``.
        batch_size: sequences processed together.
        base: the architecture to start from (config, model, ArchSpec); default by task.
        mode: ``training`` or ``inference`` (default: training for encoder tasks,
            inference for generation).

    Returns:
        :class:`Advice`; every recommendation's reason carries the cost model's numbers.

    Raises:
        ValueError: an unknown task or device, a non-positive length, budget or batch.
    """
    mode = _check_request(
        task,
        seq_len=seq_len,
        memory_gb=memory_gb,
        latency_ms=latency_ms,
        device=device,
        batch_size=batch_size,
        mode=mode,
    )
    generative = task in ("generation", "realtime")
    budget = int(memory_gb * GIB)
    spec = describe(base) if base is not None else _base_for(task)
    if generative and not spec.causal:
        spec = spec.with_(causal=True, lm_head=True)
    # the KV cache is the memory that grows with every token: the heads come first
    kv_rec, spec = kv_heads_rule(
        spec,
        task=task,
        generative=generative,
        batch_size=batch_size,
        seq_len=seq_len,
        budget=budget,
        device=device,
    )
    s = _search(
        task,
        spec,
        seq_len=seq_len,
        batch_size=batch_size,
        budget=budget,
        latency_ms=latency_ms,
        device=device,
        mode=mode,
    )
    best = s.best
    recs = [
        *attention_recs(s),
        calibrated_backend_rec(best, spec, seq_len, batch_size, s.training, device),
        positions_rec(s),
        kv_rec,
        dtype_rec(s),
        checkpointing_rec(s),
    ]
    latency = latency_rec(s)
    state_space = state_space_recommendation(
        spec,
        seq_len=seq_len,
        batch_size=batch_size,
        bytes_per_element=dtype_bytes(best.dtype),
        task=task,
    )
    recs += [r for r in (latency, state_space) if r is not None]
    notes: list[str] = []
    if s.slow:
        notes.append(
            f"no setting meets {latency_ms:g} ms (fastest that fits: "
            f"{min(p.ms for p in s.pool):.0f} ms): chose the fastest that fits"
        )
    fits = best.bytes <= budget
    if not fits:
        notes.append(
            f"even the leanest setting needs {gib(best.bytes)} over {gib(budget)}: use a smaller "
            "model, a shorter input or more memory"
        )
    chosen = spec if best.window is None else spec.with_(window=best.window, causal=True)
    return Advice(
        task=task,
        seq_len=seq_len,
        memory_bytes=budget,
        latency_ms=latency_ms,
        device=device,
        mode=mode,
        recommendations=recs,
        arch=chosen,
        estimate=best.report,
        fits=fits,
        total_bytes=best.bytes,
        notes=notes,
    )


def _check_request(
    task: str,
    *,
    seq_len: int,
    memory_gb: float,
    latency_ms: float | None,
    device: str,
    batch_size: int,
    mode: str | None,
) -> str:
    """Refuse a bad request with its value; return the mode (the task's default if None)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known: {list(TASKS)}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    check_positive_int("seq_len", seq_len)
    check_real("memory_gb", memory_gb, gt=0.0)
    if latency_ms is not None:
        check_real("latency_ms", latency_ms, gt=0.0)
    check_positive_int("batch_size", batch_size)
    mode = mode or ("inference" if task in ("generation", "realtime") else "training")
    if mode not in ("training", "inference"):
        raise ValueError(f"mode must be 'training' or 'inference', got {mode!r}")
    return mode


def _search(
    task: str,
    spec: ArchSpec,
    *,
    seq_len: int,
    batch_size: int,
    budget: int,
    latency_ms: float | None,
    device: str,
    mode: str,
) -> Search:
    """Cost every combination of window, dtype and checkpointing, and choose one.

    The choice is the most preferred plan (full attention, then the widest window; the
    device's preferred dtype; no checkpointing) that fits the memory and meets the latency;
    the fastest that fits when none meets the latency; the leanest when none fits.
    """
    generative = task in ("generation", "realtime")
    dtypes = ["float32", "bfloat16"] if device == "cpu" else ["bfloat16", "float32"]
    windows: list[int | None] = [
        None,
        *(w for w in (4096, 2048, 1024, 512, 256, 128) if w < seq_len),
    ]
    if spec.layer_windows is not None:
        windows = [None]  # a local/global layout is the model's own: costed as it is
    plans = [
        plan(
            spec,
            w,
            dt,
            ck,
            batch_size=batch_size,
            seq_len=seq_len,
            mode=mode,
            device=device,
            generative=generative,
        )
        for w in windows
        for dt in dtypes
        for ck in ((False, True) if mode == "training" else (False,))
    ]
    fit = [p for p in plans if p.bytes <= budget]
    fast = [p for p in fit if latency_ms is None or p.ms <= latency_ms]
    slow = latency_ms is not None and bool(fit) and not fast
    pool = fast or fit

    def preference(p: Plan) -> tuple[int, int, int]:
        return (windows.index(p.window), dtypes.index(p.dtype), int(p.checkpointing))

    if slow:
        best = min(pool, key=lambda p: p.ms)
    else:
        best = min(pool, key=preference) if pool else min(plans, key=lambda p: p.bytes)
    return Search(
        task=task,
        spec=spec,
        seq_len=seq_len,
        batch_size=batch_size,
        budget=budget,
        latency_ms=latency_ms,
        device=device,
        mode=mode,
        windows=windows,
        dtypes=dtypes,
        plans=plans,
        pool=pool,
        best=best,
        slow=slow,
    )
