"""Engine metrics: KV blocks, cache hits, waste, queue lengths, tokens/s, time to first token.

:meth:`EngineMetrics.prometheus` renders them in the Prometheus text exposition
format (version 0.0.4) for ``GET /metrics``.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

__all__ = ["EngineMetrics", "step_kinds_text"]

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class EngineMetrics:
    """Counters and gauges the engine updates at every step.

    Attributes:
        history: ``(seconds since start, blocks used, blocks total, waste)`` per step,
            the last 100k steps (the KV-usage plot reads it).
    """

    requests_received: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    spec_verifications: int = 0  # rows that verified drafts
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    steps: int = 0
    step_seconds: float = 0.0
    blocks_used: int = 0
    blocks_total: int = 0
    waste: float = 0.0
    waste_sum: float = 0.0
    running: int = 0
    waiting: int = 0
    ttft_count: int = 0
    ttft_sum: float = 0.0
    ttft_buckets: list[int] = field(default_factory=lambda: [0] * len(_TTFT_BUCKETS))
    history: deque[tuple[float, int, int, float]] = field(
        default_factory=lambda: deque(maxlen=100_000)
    )
    _start: float = field(default_factory=time.perf_counter)
    _recent: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=4096))

    def record_step(
        self,
        *,
        seconds: float,
        tokens: int,
        used: int,
        total: int,
        waste: float,
        running: int,
        waiting: int,
    ) -> None:
        """Account one step."""
        now = time.perf_counter()
        self.steps += 1
        self.step_seconds += seconds
        self.blocks_used, self.blocks_total = used, total
        self.waste = waste
        self.waste_sum += waste
        self.running, self.waiting = running, waiting
        self.history.append((now - self._start, used, total, waste))
        self._recent.append((now, tokens))

    def record_speculation(self, *, drafted: int, accepted: int) -> None:
        """Account one sequence's verified drafts (speculative decoding)."""
        self.spec_verifications += 1
        self.spec_draft_tokens += drafted
        self.spec_accepted_tokens += accepted

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 before any draft)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    def record_ttft(self, seconds: float) -> None:
        """Account one request's time to first token."""
        self.ttft_count += 1
        self.ttft_sum += seconds
        for i, bound in enumerate(_TTFT_BUCKETS):
            if seconds <= bound:
                self.ttft_buckets[i] += 1

    @property
    def mean_waste(self) -> float:
        """Waste averaged over the steps so far."""
        return self.waste_sum / self.steps if self.steps else 0.0

    def tokens_per_second(self, window: float = 10.0) -> float:
        """Tokens processed per second over the last ``window`` seconds."""
        now = time.perf_counter()
        recent = [(t, n) for t, n in self._recent if now - t <= window]
        if not recent:
            return 0.0
        span = max(now - recent[0][0], 1e-3)
        return sum(n for _, n in recent) / span

    def prometheus(
        self, *, cache_hit_rate: float, blocks_free: int, live: dict[str, float] | None = None
    ) -> str:
        """The metrics in Prometheus text format.

        Args:
            cache_hit_rate: prefix-cache hits / lookups.
            blocks_free: free or evictable KV blocks now.
            live: the gauges read from the engine now (``running``, ``waiting``,
                ``blocks_used``, ``waste``), over the values of its last step: after a
                request is aborted or the last one finishes no step runs, and the
                gauges must still return to their idle values.
        """
        if live:
            for name, value in live.items():
                setattr(self, name, value)
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, value: float) -> None:
            lines.extend(
                [
                    f"# HELP attnlab_{name} {help_}",
                    f"# TYPE attnlab_{name} {kind}",
                    f"attnlab_{name} {value}",
                ]
            )

        metric("requests_received_total", "counter", "Requests accepted.", self.requests_received)
        metric("requests_finished_total", "counter", "Requests completed.", self.requests_finished)
        metric(
            "requests_aborted_total",
            "counter",
            "Requests aborted (client gone).",
            self.requests_aborted,
        )
        metric(
            "prompt_tokens_total",
            "counter",
            "Prompt tokens of admitted requests.",
            self.prompt_tokens,
        )
        metric(
            "cached_prompt_tokens_total",
            "counter",
            "Prompt tokens served by the prefix cache.",
            self.cached_prompt_tokens,
        )
        metric("generation_tokens_total", "counter", "Tokens generated.", self.generation_tokens)
        metric(
            "preemptions_total",
            "counter",
            "Sequences preempted for lack of KV blocks.",
            self.preemptions,
        )
        metric("steps_total", "counter", "Engine steps.", self.steps)
        for name, help_, value in (
            (
                "spec_verifications_total",
                "Sequence rows that verified drafts.",
                self.spec_verifications,
            ),
            ("spec_draft_tokens_total", "Speculative tokens drafted.", self.spec_draft_tokens),
            ("spec_accepted_tokens_total", "Drafted tokens accepted.", self.spec_accepted_tokens),
        ):
            metric(name, "counter", help_, value)
        metric("kv_blocks_used", "gauge", "KV blocks held by sequences.", self.blocks_used)
        metric("kv_blocks_free", "gauge", "KV blocks free or evictable.", blocks_free)
        metric("kv_cache_hit_rate", "gauge", "Prefix-cache block hits / lookups.", cache_hit_rate)
        metric(
            "kv_waste_ratio",
            "gauge",
            "Allocated KV slots holding no token / allocated slots.",
            self.waste,
        )
        metric("requests_running", "gauge", "Sequences in the running batch.", self.running)
        metric("requests_waiting", "gauge", "Sequences waiting for admission.", self.waiting)
        metric(
            "tokens_per_second",
            "gauge",
            "Tokens processed per second (last 10 s).",
            round(self.tokens_per_second(), 3),
        )
        lines += [
            "# HELP attnlab_time_to_first_token_seconds Time from arrival to the first token.",
            "# TYPE attnlab_time_to_first_token_seconds histogram",
        ]
        for bound, count in zip(_TTFT_BUCKETS, self.ttft_buckets):
            lines.append(f'attnlab_time_to_first_token_seconds_bucket{{le="{bound}"}} {count}')
        lines.append(f'attnlab_time_to_first_token_seconds_bucket{{le="+Inf"}} {self.ttft_count}')
        lines.append(f"attnlab_time_to_first_token_seconds_sum {self.ttft_sum}")
        lines.append(f"attnlab_time_to_first_token_seconds_count {self.ttft_count}")
        return "\n".join(lines) + "\n"


def step_kinds_text(kinds: dict[str, int]) -> str:
    """The runner's steps by kind (:attr:`attnlab.serving.runner.ModelRunner.step_kinds`,
    ``"<kind>, <compiled|eager>"``) as a Prometheus counter with ``kind`` and ``run``
    labels."""
    lines = [
        "# HELP attnlab_steps_by_kind_total Engine steps by what they carry and how they ran.",
        "# TYPE attnlab_steps_by_kind_total counter",
    ]
    for key, count in sorted(kinds.items()):
        kind, _, run = key.rpartition(", ")
        lines.append(f'attnlab_steps_by_kind_total{{kind="{kind}",run="{run}"}} {count}')
    return "\n".join(lines) + "\n"
