"""Where one engine step's time goes: decode steps at 1, 8 and 32 streams, profiled (issue 21).

The model of ``benchmarks/serving_vllm.py`` (a random Llama, hidden 256, 4 layers, 4
heads, vocab 32000, float32) in-process, no HTTP: ``--streams`` requests of 128 prompt
tokens are prefilled, then decode steps are timed (median of ``--steps``) and one round
is profiled with ``torch.profiler`` (the top operators by self time) and split into the
engine's roles (schedule, runner forward, sample, output processing) with
``time.perf_counter`` around each call. The peer for the forward is its floor: the
step's bare matmuls (every weight multiplied once at the step's rows).

Usage::

    PYTHONPATH=src python benchmarks/serving_step.py [--streams 1 8 32] [--threads 2]
        [--temperature 1.0]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.serving import Engine, SamplingParams


class IdTokenizer:
    """Token ids as text: no tokenizer cost in the step (the output processor still runs)."""

    eos_token_id = None

    def encode(self, text: str, **_: Any) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join(f" {i}" for i in ids)


def model() -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(
        DecoderConfig.llama(
            vocab_size=32000,
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=1024,
            max_position_embeddings=2048,
        )
    ).eval()


class Timed:
    """Wraps the engine's role calls with ``perf_counter`` (summed per role)."""

    def __init__(self, engine: Engine) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        for obj, name, role in (
            (engine.scheduler, "schedule", "schedule"),
            (engine.runner, "run", "forward"),
            (engine, "_sample", "sample + output"),
            (engine.output, "collect", "collect"),
        ):
            setattr(obj, name, self._wrap(getattr(obj, name), role))

    def _wrap(self, fn: Any, role: str) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[role] += time.perf_counter() - t0

        return timed


def one(streams: int, steps: int, top: int, temperature: float = 0.0) -> list[str]:
    m = model()
    engine = Engine(m, IdTokenizer(), max_num_seqs=64)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=10_000 // 10, temperature=temperature, ignore_eos=True)
    for i in range(streams):
        engine.add_request(f"r{i}", [rng.randrange(32000) for _ in range(128)], params)
    while engine.waiting or any(not s.output_ids for s in engine.running):
        engine.step()
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    timed = Timed(engine)
    for _ in range(steps):
        engine.step()
    roles = ", ".join(f"{k} {v / steps * 1000:.2f}" for k, v in timed.seconds.items())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    ms = statistics.median(times) * 1000
    lines = [
        f"### {streams} streams, temperature {temperature}: {ms:.2f} ms per decode step, "
        f"{streams / ms * 1000:.0f} tok/s",
        "",
        f"Roles, ms per step: {roles}.",
        "",
        "| operator | self ms per step | calls per step |",
        "|---|---|---|",
    ]
    ev = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    for e in ev:
        lines.append(
            f"| {e.key} | {e.self_cpu_time_total / 1000 / steps:.2f} | {e.count / steps:.0f} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="the requests' temperature: 0 is greedy, 1 samples every row (as guidellm)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for streams in args.streams:
        lines = one(streams, args.steps, args.top, args.temperature)
        print("\n".join(["", *lines]), flush=True)


if __name__ == "__main__":
    main()
