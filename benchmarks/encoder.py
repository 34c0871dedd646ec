"""Encoder throughput: attnlab vs transformers' BertModel on all-MiniLM-L6-v2's real weights.

Runs, in one process and alternating, a forward pass of batch 32 x 128 tokens (float32,
inference mode) through:

* attnlab, default backend (``auto``: torch's fused kernel where it is exact);
* attnlab, ``reference`` backend (the full score matrix, for the record);
* transformers ``BertModel`` with ``attn_implementation="sdpa"`` (the peer) and ``"eager"``.

Prints median times and ratios to transformers sdpa, and with ``--write`` replaces the
"Encoder (issue 2)" section of docs/benchmarks.md.

    python benchmarks/encoder.py [--batch 32] [--seq 128] [--rounds 10] [--write]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch

import attnlab
from _common import machine_line, median_ms, time_interleaved, write_section
from attnlab import backends
from attnlab.interop.pretrained import minilm_path


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--padded", action="store_true", help="pad half of each batch row's tokens")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall-clock time, or this process's CPU time (with --threads 1: robust to other load)",
    )
    ap.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    import transformers

    path = minilm_path()
    ours = attnlab.from_hf(path)
    hf_sdpa = transformers.BertModel.from_pretrained(path, attn_implementation="sdpa").eval()
    hf_eager = transformers.BertModel.from_pretrained(path, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (args.batch, args.seq), generator=g)
    mask = torch.ones_like(ids)
    if args.padded:
        lengths = torch.randint(args.seq // 2, args.seq + 1, (args.batch,), generator=g)
        mask = (torch.arange(args.seq)[None, :] < lengths[:, None]).long()
    batch = {"input_ids": ids, "attention_mask": mask}

    def run_ref() -> object:
        with backends.use("reference"):
            return ours(**batch)

    fns = {
        "attnlab (auto)": lambda: ours(**batch),
        "attnlab (reference)": run_ref,
        "transformers sdpa": lambda: hf_sdpa(**batch),
        "transformers eager": lambda: hf_eager(**batch),
    }
    with torch.inference_mode():
        diff = ours(**batch).last_hidden_state - hf_sdpa(**batch).last_hidden_state
        real = mask.bool()
        max_diff = diff[real].abs().max().item()
        times = time_interleaved(fns, rounds=args.rounds, warmup=2, clock=clock)
    peer = median_ms(times["transformers sdpa"])
    rows = [
        "| implementation | median ms | ratio to transformers sdpa |",
        "|---|---|---|",
    ]
    for name, ts in times.items():
        rows.append(f"| {name} | {median_ms(ts):.1f} | {median_ms(ts) / peer:.2f} |")
    table = "\n".join(rows)
    print(
        f"batch {args.batch} x {args.seq} tokens{' (padded)' if args.padded else ''}, float32, {machine_line()}"
    )
    print(table)
    print(f"max |attnlab - transformers| on real tokens: {max_diff:.1e}")
    if args.write:
        cmd = f"python benchmarks/encoder.py --batch {args.batch} --seq {args.seq} --rounds {args.rounds}"
        cmd += " --padded" if args.padded else ""
        cmd += f" --threads {args.threads}" if args.threads else ""
        cmd += f" --clock {args.clock}"
        write_section(
            "## Encoder (issue 2)",
            f"all-MiniLM-L6-v2, batch {args.batch} x {args.seq} tokens"
            f"{' (padded rows)' if args.padded else ''}, float32, inference mode, {args.clock} clock; "
            f"{machine_line()}.\n"
            f"Command: `{cmd} --write` (median of {args.rounds} interleaved rounds).\n\n"
            f"{table}\n\nmax |attnlab - transformers| on real tokens: {max_diff:.1e}.",
        )


if __name__ == "__main__":
    main()
