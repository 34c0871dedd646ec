"""Fused q/k/v and gate/up against the separate layers, in decode steps, alternating in one run (issues 21, 23).

Two copies of the same model are laid out for the same rows
(:func:`attnlab.models.inference.pack_model`): one with ``fuse=True`` (4 matmul calls per
layer: q/k/v, o, gate/up, down), one with ``fuse=False`` (7). Then, alternating between
them in rounds (median of ``--repeats``):

- ``--part generate``: ``generate``'s decode step at ``--batches`` rows, per token, eager
  (``compile=False``) and compiled (``compile=True``: the step compiled once per batch,
  fullgraph, over a static cache), from the time of two runs of different lengths
  (``(t(N + 64) - t(N)) / 64``, so the prompt and the first step cancel); greedy tokens of
  the two copies compared.
- ``--part serving``: the serving engine's compiled decode bucket
  (:mod:`attnlab.serving.decode_buckets`) at ``--streams`` rows, ms per engine step, each
  copy in its own engine over the same requests (``--prompt-tokens`` each, random ids).

``--model llama`` is the random 4-layer Llama of ``benchmarks/serving_step.py`` (hidden
256, vocab 32000); ``--model smollm2`` SmolLM2-135M-Instruct as float32 (``--folder`` a
saved folder, e.g. ``/work/models/serving_vllm/smollm2``). ``--quantize int8`` (or
``int4``, ``int8:g32``...) quantizes both copies first: the fused copy then joins the
quantized layers (or says why it could not). The peer is the same model unfused; the
floor beside the figures is the step's matmuls alone (``benchmarks/gemm.py``).

Usage::

    PYTHONPATH=src python benchmarks/fused_step.py --part generate --batches 1 8 --threads 2
    PYTHONPATH=src python benchmarks/fused_step.py --part serving --streams 1 8 32 --threads 2
        [--model smollm2 --folder DIR] [--quantize int8]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # serving_step's model and helpers

from attnlab.generation import generate
from attnlab.models.decoder import DecoderLM
from attnlab.models.fuse import fused_projections
from attnlab.models.inference import pack_model, packing_report


def build(args: argparse.Namespace) -> DecoderLM:
    if args.folder:
        from attnlab.interop.causal_lm import load_causal_lm

        m = load_causal_lm(args.folder).model
        assert isinstance(m, DecoderLM)
        m = m.eval()
    else:
        from serving_step import model

        m = model(args.model)
    if args.quantize:
        from attnlab.models.quantize import quantize_model

        quantize_model(m, args.quantize)
    return m


def pair(args: argparse.Namespace, rows: tuple[int, ...]) -> dict[str, DecoderLM]:
    """The separate and the fused copy, laid out for ``rows``."""
    base = build(args)
    out = {"separate": base, "fused": copy.deepcopy(base)}
    for name, m in out.items():
        t = time.perf_counter()
        pack_model(m, rows=rows, fuse=name == "fused")
        report = packing_report(m)
        print(
            f"{name}: laid out in {time.perf_counter() - t:.1f} s, {report['fused']} fused "
            f"projections, kernels {report['kernels']}, {report['extra_bytes'] / 1e6:.0f} MB "
            "of copies"
        )
    if not fused_projections(out["fused"]):
        print("warning: nothing was fused (see the log of attnlab.models.fuse for why)")
    return out


def _seconds(m: DecoderLM, ids: torch.Tensor, new: int, compiled: bool) -> float:
    t = time.perf_counter()
    generate(m, ids, new, compile=compiled)
    return time.perf_counter() - t


def generate_part(args: argparse.Namespace) -> None:
    models = pair(args, tuple(args.batches))
    vocab = models["separate"].decoder_config.vocab_size
    short, long = args.new_tokens, args.new_tokens + 64
    for b in args.batches:
        ids = torch.randint(
            0, vocab, (b, args.prompt_tokens), generator=torch.Generator().manual_seed(b)
        )
        for compiled in (False, True):
            tokens = {}
            t0 = time.perf_counter()
            for name, m in models.items():  # warm (and compile)
                tokens[name] = generate(m, ids, long, compile=compiled)
                generate(m, ids, short, compile=compiled)
            warm = time.perf_counter() - t0
            per: dict[str, list[float]] = {n: [] for n in models}
            for _ in range(args.repeats):
                for name, m in models.items():
                    t_long = _seconds(m, ids, long, compiled)
                    t_short = _seconds(m, ids, short, compiled)
                    per[name].append((t_long - t_short) / 64 * 1000)
            s, f = statistics.median(per["separate"]), statistics.median(per["fused"])
            same = torch.equal(tokens["separate"], tokens["fused"])
            mode = "compiled" if compiled else "eager"
            print(
                f"| generate {mode} | batch {b} | separate {s:.2f} ms/token | fused {f:.2f} "
                f"ms/token | {s / f:.2f}x | same tokens: {same} | warm-up {warm:.0f} s |"
            )


def serving_part(args: argparse.Namespace) -> None:
    from attnlab.serving import Engine, SamplingParams
    from serving_step import IdTokenizer, _median_step

    for streams in args.streams:
        models = pair(args, (streams,))
        vocab = models["separate"].decoder_config.vocab_size
        engines = {}
        for name, m in models.items():
            engine = Engine(m, IdTokenizer(), max_num_seqs=64, max_model_len=2048)
            t = time.perf_counter()
            engine.runner.compile_buckets((streams,), max_model_len=2048, pack=False)
            print(f"{name}: bucket {streams} compiled in {time.perf_counter() - t:.0f} s")
            gen = torch.Generator().manual_seed(0)
            params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
            for i in range(streams):
                prompt = torch.randint(0, vocab, (args.prompt_tokens,), generator=gen).tolist()
                engine.add_request(f"r{i}", prompt, params)
            while engine.waiting or any(not s.output_ids for s in engine.running):
                engine.step()
            engines[name] = engine
        per: dict[str, list[float]] = {n: [] for n in engines}
        for _ in range(args.repeats):
            for name, engine in engines.items():
                per[name].append(_median_step(engine, args.steps))
        s, f = statistics.median(per["separate"]), statistics.median(per["fused"])
        outs = {n: [r.output_ids for r in e.running] for n, e in engines.items()}
        print(
            f"| serving bucket | {streams} streams | separate {s:.2f} ms/step | fused {f:.2f} "
            f"ms/step | {s / f:.2f}x | same tokens: {outs['separate'] == outs['fused']} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["generate", "serving"], required=True)
    ap.add_argument("--model", choices=["llama", "smollm2"], default="llama")
    ap.add_argument("--folder", default=None, help="a saved model folder (overrides --model)")
    ap.add_argument("--quantize", default=None, help="quantize both copies first (int8, int4...)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=8, help="the short run's new tokens")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="engine steps per serving round")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    line = next((x for x in flags.splitlines() if x.startswith("Flags")), "")
    keep = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
    print(
        f"torch {torch.__version__}, {args.threads} thread(s) for both copies; lscpu flags: "
        f"{' '.join(f for f in line.split() if f in keep)}; uptime: "
        f"{subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}"
    )
    (generate_part if args.part == "generate" else serving_part)(args)
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()
