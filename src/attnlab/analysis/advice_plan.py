"""The advisor's parts: its results, its speed assumptions, and one costed plan.

* :class:`Recommendation` and :class:`Advice`: what :func:`attnlab.analysis.advisor.advise`
  returns;
* the speeds it assumes (:data:`CPU_GFLOPS`, :data:`CPU_GBPS`, the CUDA figures);
* :func:`plan`: one setting (window, dtype, checkpointing) costed by
  :func:`~attnlab.analysis.cost.estimate`, with its time per forward or per token;
* :func:`calibrated_backend_rec`: the registry's ranking of backends for the chosen plan.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from attnlab.analysis.arch import ArchSpec
from attnlab.analysis.backend_choice import auto_choice
from attnlab.analysis.cost import CostReport, estimate, human_bytes

logger = logging.getLogger(__name__)

__all__ = [
    "CPU_GBPS",
    "CPU_GFLOPS",
    "CUDA_GBPS",
    "CUDA_TFLOPS",
    "CUDA_UTILISATION",
    "GIB",
    "Advice",
    "Plan",
    "Recommendation",
    "calibrated_backend_rec",
    "gib",
    "plan",
]

GIB = 1024**3

#: Matmul throughput (GFLOP/s) measured on the project's 2-core CPU.
CPU_GFLOPS = {"float32": 175.0, "bfloat16": 400.0}
#: Assumed dense bf16 throughput of a data-centre GPU (no measurement here), TFLOP/s.
CUDA_TFLOPS = 400.0
CUDA_UTILISATION = 0.4
#: Assumed memory bandwidths (GB/s) for decoding, which reads weights and cache per token.
CPU_GBPS = 20.0
CUDA_GBPS = 3000.0


@dataclass
class Recommendation:
    """One choice and why.

    Attributes:
        topic: ``attention``, ``backend``, ``positions``, ``kv_heads``, ``window``, ``dtype``,
            ``checkpointing`` or ``latency``.
        choice: what to use.
        reason: the numbers behind it.
    """

    topic: str
    choice: str
    reason: str


@dataclass
class Advice:
    """What :func:`advise` recommends.

    Attributes:
        task: the task.
        seq_len: tokens per sequence.
        memory_bytes: the memory budget.
        latency_ms: the latency budget, if any.
        device: ``cpu`` or ``cuda``.
        mode: what was costed (``training`` for encoder tasks, ``inference`` otherwise).
        recommendations: one per topic.
        arch: the recommended architecture.
        estimate: the cost report of the recommendation.
        fits: whether the recommendation fits the memory budget.
        total_bytes: memory of the recommendation: the report's total plus, when
            generating, the KV cache (what is compared with the budget).
        notes: remarks that are not about one topic.
    """

    task: str
    seq_len: int
    memory_bytes: int
    latency_ms: float | None
    device: str
    mode: str
    recommendations: list[Recommendation]
    arch: ArchSpec
    estimate: CostReport
    fits: bool = True
    total_bytes: int = 0
    notes: list[str] = field(default_factory=list)

    def get(self, topic: str) -> Recommendation:
        """The recommendation about ``topic``; ``KeyError`` if there is none."""
        for r in self.recommendations:
            if r.topic == topic:
                return r
        raise KeyError(topic)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["estimate"] = self.estimate.to_dict()
        return d

    def summary(self) -> str:
        head = (
            f"{self.task}, {self.seq_len} tokens, {human_bytes(self.memory_bytes)} of memory"
            + (f", {self.latency_ms:g} ms" if self.latency_ms else "")
            + f", {self.device} ({self.mode} costed)"
        )
        lines = [head]
        for r in self.recommendations:
            lines.append(f"  {r.topic:<13} {r.choice}")
            lines.append(f"  {'':<13} why: {r.reason}")
        lines.append(
            f"  total: {human_bytes(self.total_bytes or self.estimate.total_bytes)} "
            + ("(fits)" if self.fits else "(does NOT fit: see above)")
        )
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def gib(n: float) -> str:
    return human_bytes(n)


def seconds(flops: float, device: str, dtype: str) -> float:
    if device == "cpu":
        return flops / (CPU_GFLOPS.get(dtype, CPU_GFLOPS["float32"]) * 1e9)
    return flops / (CUDA_TFLOPS * 1e12 * CUDA_UTILISATION)


@dataclass
class Plan:
    window: int | None
    dtype: str
    checkpointing: bool
    report: CostReport
    bytes: int
    ms: float
    forward_flops: float
    kv_bytes: int
    density: float
    backend: str


def plan(
    spec: ArchSpec,
    window: int | None,
    dtype: str,
    checkpointing: bool,
    *,
    batch_size: int,
    seq_len: int,
    mode: str,
    device: str,
    generative: bool,
    backend: str | None = None,
) -> Plan:
    s = spec if window is None else spec.with_(window=window, causal=True, layer_windows=None)
    # a mixed local/global layout keeps its own caches: rolling on local layers
    cache = None if s.layer_windows is not None else "sliding" if window else "dynamic"
    backend = backend or "auto"
    common: dict[str, Any] = dict(
        batch_size=batch_size, seq_len=seq_len, dtype=dtype, backend=backend
    )
    r = estimate(s, mode=mode, checkpointing=checkpointing, **common)  # type: ignore[arg-type]
    fwd = r if mode == "inference" else estimate(s, **common)
    kv = 0
    if generative:
        step = estimate(s, mode="decode", cache=cache, **common)
        kv = step.kv_cache_bytes
        # decoding is bound by reading the weights and the cache once per token
        ms = (
            seconds(step.flops, device, dtype) + (step.parameter_bytes + kv) / _gbps(device)
        ) * 1e3
    else:
        ms = seconds(fwd.flops, device, dtype) * 1e3
    return Plan(
        window=window,
        dtype=dtype,
        checkpointing=checkpointing,
        report=r,
        bytes=r.total_bytes + kv,
        ms=ms,
        forward_flops=fwd.flops,
        kv_bytes=kv,
        density=fwd.attention_density,
        backend=backend,
    )


def _gbps(device: str) -> float:
    return (CPU_GBPS if device == "cpu" else CUDA_GBPS) * 1e9


def calibrated_backend_rec(
    best: Plan, spec: ArchSpec, seq_len: int, batch_size: int, training: bool, device: str
) -> Recommendation:
    """Ask the registry which backend runs one layer's attention of the chosen plan fastest.

    The registry's ranking comes back as data (``Explanation.estimates``, seconds per
    backend that can run the call, from the constants measured on the project's machine);
    nothing here restates a backend's speed.
    """
    try:
        from attnlab.backends.cost_model import format_seconds

        why = auto_choice(
            batch_size=batch_size,
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            q_len=seq_len,
            kv_len=seq_len,
            dtype=best.dtype,
            training=training,
            causal=spec.causal,
            window=best.window or None,
            device=device,
        )
    except Exception:  # the registry's model is an aid, never a reason to fail
        logger.debug("calibrated backend choice failed", exc_info=True)
        return Recommendation(
            "backend", "auto", "let auto choose per call (its cost model was unavailable here)"
        )
    ranked = [f"{name} {format_seconds(s)}" for name, s in why.estimates.items()]
    where = "" if device == "cpu" else f" (constants measured on cpu, not {device})"
    reason = (
        f"per layer{' (forward + backward)' if training else ''}, auto's cost model{where} "
        f"ranks: {', '.join(ranked[:4])}"
    )
    return Recommendation("backend", why.chosen, reason)
