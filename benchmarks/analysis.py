"""Analysis tools' overhead: the diagnostics' hooks on all-MiniLM-L6-v2, and the cost model's speed.

Measures, in one process and alternating:

* a forward pass of batch 32 x 128 tokens (float32, default backend) through attnlab's
  all-MiniLM-L6-v2, bare and inside ``NonFiniteWatch`` (the forward hooks of
  ``attnlab.analysis.diagnose``: one float32 sum per module output); the peer is the
  bare forward. Target: at most 20 % overhead;
* the same with attention statistics: ``diagnose(...)`` in full (weights requested, so
  ``auto`` picks a backend that returns them) against a bare forward that also returns
  the weights;
* ``estimate()`` per call on every preset and mode (target: under 50 ms), and the
  ``attnlab estimate`` command end to end (a fresh Python process printing the table).

    python benchmarks/analysis.py [--batch 32] [--seq 128] [--rounds 10] [--write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch

import attnlab
from _common import machine_line, median_ms, time_interleaved, write_section
from attnlab.analysis.arch import PRESETS
from attnlab.analysis.cost import estimate
from attnlab.analysis.diagnostics import NonFiniteWatch, diagnose
from attnlab.interop.pretrained import minilm_path

HEADING = "## Analysis (issue 5)"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--write", action="store_true", help="write the tables into docs/benchmarks.md")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model = attnlab.from_hf(minilm_path()).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (args.batch, args.seq), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def bare() -> object:
        with torch.no_grad():
            return model(**batch)

    def watched() -> object:
        with torch.no_grad(), NonFiniteWatch(model):
            return model(**batch)

    def bare_weights() -> object:
        with torch.no_grad():
            return model(**batch, output_attentions=True)

    def full() -> object:
        return diagnose(model, batch)

    fns = {"bare": bare, "watched": watched, "bare_weights": bare_weights, "full": full}
    t = time_interleaved(fns, rounds=args.rounds)
    ms = {k: median_ms(v) for k, v in t.items()}
    # the machine is shared: CPU time of this process counts the work, not the waiting
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(args.rounds):
        for k, fn in fns.items():
            c0 = time.process_time()
            fn()
            cpu[k].append(time.process_time() - c0)
    cms = {k: median_ms(v) for k, v in cpu.items()}
    hooks = ms["watched"] / ms["bare"] - 1
    stats = ms["full"] / ms["bare_weights"] - 1
    hooks_cpu = cms["watched"] / cms["bare"] - 1
    stats_cpu = cms["full"] / cms["bare_weights"] - 1

    calls = []
    cases = [(p, m) for p in PRESETS for m in ("inference", "training", "decode")]
    for _ in range(5):
        t0 = time.perf_counter()
        for name, mode in cases:
            for n in (128, 2048, 32768):
                estimate(PRESETS[name], seq_len=n, mode=mode)  # type: ignore[arg-type]
        calls.append((time.perf_counter() - t0) / (len(cases) * 3))
    per_call = 1000 * statistics.median(calls)
    src = Path(__file__).resolve().parent.parent / "src"
    env = dict(os.environ, PYTHONPATH=str(src))
    cli = []
    for _ in range(5):
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "attnlab.cli", "estimate"],
            check=True,
            env=env,
            capture_output=True,
        )
        cli.append(time.perf_counter() - t0)
    cli_ms = 1000 * statistics.median(cli)

    body = f"""Diagnostics' hooks on all-MiniLM-L6-v2, batch {args.batch} x {args.seq} tokens, float32,
median of {args.rounds} alternating rounds ({machine_line()}):

| forward | wall ms | overhead | CPU ms | overhead |
|---|---|---|---|---|
| bare forward (default backend) | {ms["bare"]:.1f} | | {cms["bare"]:.1f} | |
| inside `NonFiniteWatch` (the hooks of `diagnose`) | {ms["watched"]:.1f} | {hooks:+.1%} | {cms["watched"]:.1f} | {hooks_cpu:+.1%} |
| bare forward returning the weights (auto picks a backend that returns them) | {ms["bare_weights"]:.1f} | | {cms["bare_weights"]:.1f} | |
| `diagnose()` in full: hooks + weights + per-head statistics | {ms["full"]:.1f} | {stats:+.1%} | {cms["full"]:.1f} | {stats_cpu:+.1%} |

Target for the hooks: at most +20 %. "CPU ms" is this process's CPU time (all its threads), which
the other jobs on the shared machine disturb less than the wall clock.

Cost model (`estimate`, pure arithmetic): {per_call:.3f} ms per call, median over every preset
({len(PRESETS)}) x mode (3) x length (128, 2048, 32768) (target < 50 ms). `attnlab estimate`
end to end (a fresh Python process, the full table of 27 rows, torch never imported):
{cli_ms:.0f} ms.

Command: `PYTHONPATH=src python benchmarks/analysis.py --batch {args.batch} --rounds {args.rounds} --threads {args.threads} --write`
"""
    print(body)
    if args.write:
        write_section(HEADING, body)


if __name__ == "__main__":
    main()
