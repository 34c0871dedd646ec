"""The advisor's topics, one function each, explaining the plan that the search chose.

:func:`attnlab.analysis.advisor.advise` costs every combination of window, dtype and
checkpointing (:func:`~attnlab.analysis.advice_plan.plan`) and keeps the results in a
:class:`Search`; each function here turns that search into the recommendation of one
topic, its reason carrying the numbers:

* :func:`attention_recs`: the attention variant and its window (a pretrained mixed
  layout is reported by :func:`~attnlab.analysis.advice_rules.layout_recs`);
* :func:`positions_rec`, :func:`dtype_rec`, :func:`checkpointing_rec` and
  :func:`latency_rec`.

The KV heads and the backend have their own rules (:mod:`attnlab.analysis.advice_rules`,
:func:`~attnlab.analysis.advice_plan.calibrated_backend_rec`).
"""

from __future__ import annotations

from dataclasses import dataclass

from attnlab.analysis.advice_plan import (
    CPU_GBPS,
    CPU_GFLOPS,
    CUDA_GBPS,
    CUDA_TFLOPS,
    CUDA_UTILISATION,
    Plan,
    Recommendation,
    gib,
    plan,
)
from attnlab.analysis.advice_rules import layout_recs
from attnlab.analysis.arch import ArchSpec
from attnlab.analysis.cost import human_flops

__all__ = [
    "Search",
    "attention_recs",
    "checkpointing_rec",
    "dtype_rec",
    "latency_rec",
    "positions_rec",
]


@dataclass(frozen=True)
class Search:
    """The request, every costed plan, and the plan chosen among them.

    Attributes:
        task: the advisor's task.
        spec: the architecture searched (with the chosen KV heads).
        seq_len: tokens per sequence.
        batch_size: sequences processed together.
        budget: the memory budget in bytes.
        latency_ms: the latency budget, if any.
        device: ``cpu`` or ``cuda``.
        mode: ``training`` or ``inference``.
        windows: the windows searched, in order of preference (``None``: full attention).
        dtypes: the dtypes searched, in order of preference.
        plans: every plan costed.
        pool: the plans that fit the memory (and the latency, when some do).
        best: the chosen plan (the leanest plan when none fits).
        slow: a latency budget no plan that fits meets.
    """

    task: str
    spec: ArchSpec
    seq_len: int
    batch_size: int
    budget: int
    latency_ms: float | None
    device: str
    mode: str
    windows: list[int | None]
    dtypes: list[str]
    plans: list[Plan]
    pool: list[Plan]
    best: Plan
    slow: bool

    @property
    def generative(self) -> bool:
        return self.task in ("generation", "realtime")

    @property
    def training(self) -> bool:
        return self.mode == "training"

    @property
    def unit(self) -> str:
        return "per generated token" if self.generative else "per forward"

    def costed(
        self,
        spec: ArchSpec,
        window: int | None,
        dtype: str,
        checkpointing: bool,
        backend: str | None = None,
    ) -> Plan:
        """One more plan at the request's sizes (e.g. another backend or fewer layers)."""
        return plan(
            spec,
            window,
            dtype,
            checkpointing,
            batch_size=self.batch_size,
            seq_len=self.seq_len,
            mode=self.mode,
            device=self.device,
            generative=self.generative,
            backend=backend,
        )

    def neighbour(self, differs: str, window: int | None = None) -> Plan | None:
        """The first plan that differs from the best in one setting only.

        Args:
            differs: ``window`` (then the plan with ``window``), ``dtype`` or
                ``checkpointing`` (then the plan with the other value).
        """
        best = self.best
        for p in self.plans:
            rest = ("window", "dtype", "checkpointing")
            same = all(getattr(p, k) == getattr(best, k) for k in rest if k != differs)
            if differs == "window":
                other = p.window == window
            else:
                other = getattr(p, differs) != getattr(best, differs)
            if same and other:
                return p
        return None


# --------------------------------------------------------------------------- attention


def _dense_reason(s: Search) -> str:
    """Why full attention: its memory, and for long documents what a 512 window would save."""
    best = s.best
    how = (
        " with a tiled kernel"
        + (" in bfloat16" if best.dtype == "bfloat16" and s.device == "cpu" else "")
        + (" and checkpointing" if best.checkpointing else "")
    )
    reason = (
        f"full attention at {s.seq_len} tokens: {gib(best.report.activation_bytes)} of "
        f"activations, {gib(best.bytes)} in all{how}, within your {gib(s.budget)}"
    )
    w512 = s.neighbour("window", 512) if s.task == "long-document" else None
    if w512 is None:
        return reason
    saved = best.bytes - w512.bytes
    return (
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


def _window_reason(s: Search) -> str:
    """Why a sliding window: what full attention would need at its leanest."""
    best = s.best
    lean_dense = min((p for p in s.plans if p.window is None), key=lambda p: p.bytes)
    why = (
        f"over your {gib(s.budget)}"
        if lean_dense.bytes > s.budget
        else f"{lean_dense.ms:.0f} ms {s.unit}, over your {s.latency_ms:g} ms"
    )
    return (
        f"full attention at {s.seq_len} tokens needs {gib(lean_dense.bytes)} even in "
        f"{lean_dense.dtype}{' with checkpointing' if lean_dense.checkpointing else ''} ({why}); "
        f"a {best.window}-key window needs {gib(best.bytes)} and about {best.ms:.0f} ms {s.unit}: "
        + ("the fastest setting that fits" if s.slow else "the widest window that fits")
    )


def _nothing_fits_reason(s: Search) -> str:
    """No plan fits: how much linear attention would save, and why it is not enough."""
    lin = s.costed(s.spec, None, s.dtypes[-1], s.training, backend="linear")
    return (
        f"the leanest setting needs {gib(s.best.bytes)} over your {gib(s.budget)}; linear "
        f"attention would need {gib(lin.bytes)} (it removes the score matrix but not the "
        "weights, optimizer state and hidden activations)"
    )


def _window_rec(s: Search) -> Recommendation:
    best = s.best
    if not best.window:
        return Recommendation("window", "none", "full attention needs no window")
    reason = f"each query sees {best.window} keys: {best.density:.1%} of the score matrix" + (
        f"; the KV cache stops growing at {gib(best.kv_bytes)}" if s.generative else ""
    )
    return Recommendation("window", str(best.window), reason)


def attention_recs(s: Search) -> list[Recommendation]:
    """The ``attention`` and ``window`` recommendations."""
    if s.spec.layer_windows is not None:
        attn, reason, window_rec = layout_recs(s.spec, s.best, s.budget, s.generative)
        return [Recommendation("attention", attn, reason), window_rec]
    if not s.pool:
        attn, reason = "none fits: linear attention or a smaller model", _nothing_fits_reason(s)
    elif s.best.window is None:
        attn, reason = "dense (full) attention", _dense_reason(s)
    else:
        attn = f"sliding-window attention, window {s.best.window}"
        reason = _window_reason(s)
    return [Recommendation("attention", attn, reason), _window_rec(s)]


# --------------------------------------------------------------------------- other topics


def positions_rec(s: Search) -> Recommendation:
    """Learned positions where pretrained encoders' tables cover the length, else RoPE/ALiBi."""
    limit = s.spec.max_positions or 512
    table_params = s.seq_len * s.spec.hidden_size
    n = s.seq_len
    if s.task == "classification" and n <= limit:
        return Recommendation(
            "positions",
            "learned absolute (BERT)",
            f"{n} tokens fit the {limit} learned positions of pretrained encoders, whose "
            f"checkpoints you can fine-tune; the table costs {table_params * 4 / 2**20:.1f} MiB",
        )
    if s.generative:
        return Recommendation(
            "positions",
            "RoPE",
            f"relative positions, no table (a learned table for {n} positions would add "
            f"{table_params / 1e6:.1f} M parameters), and RoPE scaling extends the context later",
        )
    return Recommendation(
        "positions",
        "RoPE or ALiBi",
        f"{n} tokens exceed the {limit} learned positions of BERT-style checkpoints "
        f"({n / limit:.0f}x); relative schemes need no table and extrapolate (ALiBi best)",
    )


def dtype_rec(s: Search) -> Recommendation:
    """The chosen dtype against the same plan in the other dtype."""
    best, budget, unit = s.best, s.budget, s.unit
    other = s.neighbour("dtype")
    if other is None:
        reason = f"{best.dtype}"
    elif best.dtype == "float32":
        reason = (
            f"float32 fits ({gib(best.bytes)} of {gib(budget)})"
            + (
                f" and meets {s.latency_ms:g} ms ({best.ms:.0f} ms)"
                if s.latency_ms and best.ms <= s.latency_ms
                else ""
            )
            + f"; bfloat16 would need {gib(other.bytes)} and about {other.ms:.0f} ms {unit} "
            f"(matmuls ~{CPU_GFLOPS['bfloat16'] / CPU_GFLOPS['float32']:.1f}x faster on this CPU, "
            "8 bits of mantissa)"
        )
    elif s.device == "cpu":
        problem = (
            f"needs {gib(other.bytes)} over your {gib(budget)}"
            if other.bytes > budget
            else f"takes about {other.ms:.0f} ms {unit}, over your {s.latency_ms:g} ms"
        )
        reason = (
            f"float32 {problem}; bfloat16 needs {gib(best.bytes)} and about {best.ms:.0f} ms "
            f"({CPU_GFLOPS['bfloat16']:.0f} vs {CPU_GFLOPS['float32']:.0f} GFLOP/s measured for matmuls)"
        )
    else:
        reason = (
            f"bfloat16: {gib(best.bytes)} vs {gib(other.bytes)} in float32, tensor-core speed, "
            "and float32's exponent range (no overflow, unlike float16)"
        )
    return Recommendation("dtype", best.dtype, reason)


def checkpointing_rec(s: Search) -> Recommendation:
    """Training: the plan with and without per-layer checkpointing; inference: off."""
    if not s.training:
        return Recommendation(
            "checkpointing", "off", "inference keeps no activations for a backward pass"
        )
    best, budget = s.best, s.budget
    flip = s.neighbour("checkpointing")
    assert flip is not None
    on, off = (best, flip) if best.checkpointing else (flip, best)
    if best.checkpointing:
        reason = (
            f"without it activations take {gib(off.report.activation_bytes)} and the total "
            f"{gib(off.bytes)}, over your {gib(budget)}; with it {gib(on.report.activation_bytes)} "
            f"and {gib(on.bytes)}, for one more forward per step ({human_flops(off.report.flops)} -> "
            f"{human_flops(on.report.flops)})"
        )
    else:
        reason = (
            f"the total without it, {gib(off.bytes)}, "
            + ("fits in" if off.bytes <= budget else "does not fit either way in")
            + f" {gib(budget)}; checkpointing would cut activations from "
            f"{gib(off.report.activation_bytes)} to {gib(on.report.activation_bytes)} for "
            f"{on.report.flops / off.report.flops - 1:.0%} more compute"
        )
    return Recommendation(
        "checkpointing", "on (per layer)" if best.checkpointing else "off", reason
    )


def latency_rec(s: Search) -> Recommendation | None:
    """Against a latency budget: the time of the plan, and of half the layers when over."""
    if s.latency_ms is None:
        return None
    best, spec, budget_ms = s.best, s.spec, s.latency_ms
    speed = (
        f"{CPU_GFLOPS.get(best.dtype, 175.0):.0f} GFLOP/s measured, {CPU_GBPS:.0f} GB/s assumed"
        if s.device == "cpu"
        else f"{CUDA_TFLOPS:.0f} TFLOP/s at {CUDA_UTILISATION:.0%} and {CUDA_GBPS:.0f} GB/s (assumed)"
    )
    what = "one decoding step" if s.generative else "one forward"
    if best.ms <= budget_ms:
        return Recommendation(
            "latency",
            "meets the budget",
            f"{what}: about {best.ms:.0f} ms ({speed}), within {budget_ms:g} ms",
        )
    half = max(1, spec.num_layers // 2)
    # a local/global layout keeps its pattern: the first half of its layers
    windows = None if spec.layer_windows is None else spec.layer_windows[:half]
    fewer = spec.with_(num_layers=half, layer_windows=windows)
    small = s.costed(fewer, best.window, best.dtype, best.checkpointing)
    return Recommendation(
        "latency",
        "over budget: distil or shorten the input",
        f"{what}: about {best.ms:.0f} ms ({speed}), over {budget_ms:g} ms; half the layers "
        f"({half}, a distilled model as the tutorial suggests) about {small.ms:.0f} ms",
    )
