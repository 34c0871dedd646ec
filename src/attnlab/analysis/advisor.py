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
    CPU_GBPS,
    CPU_GFLOPS,
    CUDA_GBPS,
    CUDA_TFLOPS,
    CUDA_UTILISATION,
    GIB,
    Advice,
    Plan,
    Recommendation,
    calibrated_backend_rec,
    gib,
    plan,
)
from attnlab.analysis.advice_rules import kv_heads_rule, layout_recs
from attnlab.analysis.arch import ArchSpec, describe, preset
from attnlab.analysis.cost import human_flops

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
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known: {list(TASKS)}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    check_positive_int("seq_len", seq_len)
    check_real("memory_gb", memory_gb, gt=0.0)
    if latency_ms is not None:
        check_real("latency_ms", latency_ms, gt=0.0)
    check_positive_int("batch_size", batch_size)
    generative = task in ("generation", "realtime")
    mode = mode or ("inference" if generative else "training")
    if mode not in ("training", "inference"):
        raise ValueError(f"mode must be 'training' or 'inference', got {mode!r}")
    budget = int(memory_gb * GIB)
    spec = describe(base) if base is not None else _base_for(task)
    if generative and not spec.causal:
        spec = spec.with_(causal=True, lm_head=True)
    recs: list[Recommendation] = []
    notes: list[str] = []
    training = mode == "training"

    # -- KV heads (decoders): the cache is the memory that grows with every token ----------
    kv_rec, spec = kv_heads_rule(
        spec,
        task=task,
        generative=generative,
        batch_size=batch_size,
        seq_len=seq_len,
        budget=budget,
        device=device,
    )

    # -- every combination of window, dtype and checkpointing, costed -----------------------
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
        for ck in ((False, True) if training else (False,))
    ]
    fit = [p for p in plans if p.bytes <= budget]
    fast = [p for p in fit if latency_ms is None or p.ms <= latency_ms]
    slow = latency_ms is not None and bool(fit) and not fast
    if slow:
        notes.append(
            f"no setting meets {latency_ms:g} ms (fastest that fits: "
            f"{min(p.ms for p in fit):.0f} ms): chose the fastest that fits"
        )
    pool = fast or fit

    def pref(p: Plan) -> tuple[int, int, int]:
        return (windows.index(p.window), dtypes.index(p.dtype), int(p.checkpointing))

    if slow:
        best = min(pool, key=lambda p: p.ms)
    else:
        best = min(pool, key=pref) if pool else min(plans, key=lambda p: p.bytes)
    lean_dense = min((p for p in plans if p.window is None), key=lambda p: p.bytes)
    unit = "per generated token" if generative else "per forward"

    # -- attention variant and window --------------------------------------------------------
    if best.window is None:
        attn = "dense (full) attention"
        how = (
            " with a tiled kernel"
            + (" in bfloat16" if best.dtype == "bfloat16" and device == "cpu" else "")
            + (" and checkpointing" if best.checkpointing else "")
        )
        reason = (
            f"full attention at {seq_len} tokens: {gib(best.report.activation_bytes)} of "
            f"activations, {gib(best.bytes)} in all{how}, within your {gib(budget)}"
        )
        if task == "long-document":
            w512 = next(
                (
                    p
                    for p in plans
                    if p.window == 512
                    and p.dtype == best.dtype
                    and p.checkpointing == best.checkpointing
                ),
                None,
            )
            if w512 is not None:
                saved = best.bytes - w512.bytes
                reason = (
                    "the tutorial suggests a 512 window for long documents, but the numbers win: "
                    + reason
                    + f"; a 512 window would cut the forward from {human_flops(best.forward_flops)} "
                    f"to {human_flops(w512.forward_flops)} but "
                    + (
                        f"save only {gib(saved)}"
                        if saved > 0.01 * best.bytes
                        else "save no memory (a tiled kernel's memory is linear in length either way)"
                    )
                    + ", and it drops the context beyond the window"
                )
    else:
        attn = f"sliding-window attention, window {best.window}"
        why = (
            f"over your {gib(budget)}"
            if lean_dense.bytes > budget
            else f"{lean_dense.ms:.0f} ms {unit}, over your {latency_ms:g} ms"
        )
        reason = (
            f"full attention at {seq_len} tokens needs {gib(lean_dense.bytes)} even in "
            f"{lean_dense.dtype}{' with checkpointing' if lean_dense.checkpointing else ''} ({why}); "
            f"a {best.window}-key window needs {gib(best.bytes)} and about {best.ms:.0f} ms {unit}: "
            + ("the fastest setting that fits" if slow else "the widest window that fits")
        )
    if not pool:
        lin = plan(
            spec,
            None,
            dtypes[-1],
            training,
            batch_size=batch_size,
            seq_len=seq_len,
            mode=mode,
            device=device,
            generative=generative,
            backend="linear",
        )
        attn = "none fits: linear attention or a smaller model"
        reason = (
            f"the leanest setting needs {gib(best.bytes)} over your {gib(budget)}; linear "
            f"attention would need {gib(lin.bytes)} (it removes the score matrix but not the "
            "weights, optimizer state and hidden activations)"
        )
    if spec.layer_windows is not None:
        attn, reason, window_rec = layout_recs(spec, best, budget, generative)
        recs += [Recommendation("attention", attn, reason), window_rec]
    else:
        recs.append(Recommendation("attention", attn, reason))
        recs.append(
            Recommendation(
                "window",
                str(best.window) if best.window else "none",
                (
                    f"each query sees {best.window} keys: {best.density:.1%} of the score matrix"
                    + (
                        f"; the KV cache stops growing at {gib(best.kv_bytes)}"
                        if generative
                        else ""
                    )
                )
                if best.window
                else "full attention needs no window",
            )
        )

    # -- backend -------------------------------------------------------------------------------
    recs.append(calibrated_backend_rec(best, spec, seq_len, batch_size, training, device))
    # -- positions -----------------------------------------------------------------------------
    limit = spec.max_positions or 512
    table_params = seq_len * spec.hidden_size
    if task == "classification" and seq_len <= limit:
        pos, preason = (
            "learned absolute (BERT)",
            f"{seq_len} tokens fit the {limit} learned positions of pretrained encoders, whose "
            f"checkpoints you can fine-tune; the table costs {table_params * 4 / 2**20:.1f} MiB",
        )
    elif generative:
        pos, preason = (
            "RoPE",
            f"relative positions, no table (a learned table for {seq_len} positions would add "
            f"{table_params / 1e6:.1f} M parameters), and RoPE scaling extends the context later",
        )
    else:
        pos, preason = (
            "RoPE or ALiBi",
            f"{seq_len} tokens exceed the {limit} learned positions of BERT-style checkpoints "
            f"({seq_len / limit:.0f}x); relative schemes need no table and extrapolate (ALiBi best)",
        )
    recs.append(Recommendation("positions", pos, preason))

    recs.append(kv_rec)

    # -- dtype ------------------------------------------------------------------------------------
    other = next(
        (
            p
            for p in plans
            if p.window == best.window
            and p.checkpointing == best.checkpointing
            and p.dtype != best.dtype
        ),
        None,
    )
    if other is None:
        dreason = f"{best.dtype}"
    elif best.dtype == "float32":
        dreason = (
            f"float32 fits ({gib(best.bytes)} of {gib(budget)})"
            + (
                f" and meets {latency_ms:g} ms ({best.ms:.0f} ms)"
                if latency_ms and best.ms <= latency_ms
                else ""
            )
            + f"; bfloat16 would need {gib(other.bytes)} and about {other.ms:.0f} ms {unit} "
            f"(matmuls ~{CPU_GFLOPS['bfloat16'] / CPU_GFLOPS['float32']:.1f}x faster on this CPU, "
            "8 bits of mantissa)"
        )
    elif device == "cpu":
        problem = (
            f"needs {gib(other.bytes)} over your {gib(budget)}"
            if other.bytes > budget
            else f"takes about {other.ms:.0f} ms {unit}, over your {latency_ms:g} ms"
        )
        dreason = (
            f"float32 {problem}; bfloat16 needs {gib(best.bytes)} and about {best.ms:.0f} ms "
            f"({CPU_GFLOPS['bfloat16']:.0f} vs {CPU_GFLOPS['float32']:.0f} GFLOP/s measured for matmuls)"
        )
    else:
        dreason = (
            f"bfloat16: {gib(best.bytes)} vs {gib(other.bytes)} in float32, tensor-core speed, "
            "and float32's exponent range (no overflow, unlike float16)"
        )
    recs.append(Recommendation("dtype", best.dtype, dreason))

    # -- checkpointing ----------------------------------------------------------------------------
    if training:
        flip = next(
            (
                p
                for p in plans
                if p.window == best.window
                and p.dtype == best.dtype
                and p.checkpointing != best.checkpointing
            ),
            None,
        )
        assert flip is not None
        on, off = (best, flip) if best.checkpointing else (flip, best)
        if best.checkpointing:
            creason = (
                f"without it activations take {gib(off.report.activation_bytes)} and the total "
                f"{gib(off.bytes)}, over your {gib(budget)}; with it {gib(on.report.activation_bytes)} "
                f"and {gib(on.bytes)}, for one more forward per step ({human_flops(off.report.flops)} -> "
                f"{human_flops(on.report.flops)})"
            )
        else:
            creason = (
                f"the total without it, {gib(off.bytes)}, "
                + ("fits in" if off.bytes <= budget else "does not fit either way in")
                + f" {gib(budget)}; checkpointing would cut activations from "
                f"{gib(off.report.activation_bytes)} to {gib(on.report.activation_bytes)} for "
                f"{on.report.flops / off.report.flops - 1:.0%} more compute"
            )
        recs.append(
            Recommendation(
                "checkpointing", "on (per layer)" if best.checkpointing else "off", creason
            )
        )
    else:
        recs.append(
            Recommendation(
                "checkpointing", "off", "inference keeps no activations for a backward pass"
            )
        )

    # -- latency ------------------------------------------------------------------------------
    if latency_ms is not None:
        speed = (
            f"{CPU_GFLOPS.get(best.dtype, 175.0):.0f} GFLOP/s measured, {CPU_GBPS:.0f} GB/s assumed"
            if device == "cpu"
            else f"{CUDA_TFLOPS:.0f} TFLOP/s at {CUDA_UTILISATION:.0%} and {CUDA_GBPS:.0f} GB/s (assumed)"
        )
        what = "one decoding step" if generative else "one forward"
        if best.ms <= latency_ms:
            choice, lreason = (
                "meets the budget",
                f"{what}: about {best.ms:.0f} ms ({speed}), within {latency_ms:g} ms",
            )
        else:
            small = plan(
                spec.with_(num_layers=max(1, spec.num_layers // 2)),
                best.window,
                best.dtype,
                best.checkpointing,
                batch_size=batch_size,
                seq_len=seq_len,
                mode=mode,
                device=device,
                generative=generative,
            )
            choice = "over budget: distil or shorten the input"
            lreason = (
                f"{what}: about {best.ms:.0f} ms ({speed}), over {latency_ms:g} ms; half the layers "
                f"({max(1, spec.num_layers // 2)}, a distilled model as the tutorial suggests) about "
                f"{small.ms:.0f} ms"
            )
        recs.append(Recommendation("latency", choice, lreason))
    # -- state-space alternative (long contexts) --------------------------------------------
    from attnlab.analysis.advice_recurrent import state_space_recommendation
    from attnlab.analysis.cost import dtype_bytes

    ss = state_space_recommendation(
        spec,
        seq_len=seq_len,
        batch_size=batch_size,
        bytes_per_element=dtype_bytes(best.dtype),
        task=task,
    )
    if ss is not None:
        recs.append(ss)
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
