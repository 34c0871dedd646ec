"""Paged decode attention: the block-table path (``paged``) against the gather path and the floor.

One decode step of one attention layer of the issue's Llama-shaped model (8 query heads,
2 key/value heads, head dim 64, float32) over a paged pool (blocks of 16 tokens, handed
out interleaved across rows, as a serving engine's decode appends them): each row writes
its new key/value through the block table, then attends over its context.

* ``gather``: the reference path: ``PagedKVCache.update`` copies every row's keys/values
  through its table into a left-padded batch, and the backend ``auto`` picks for that
  batch (named in the table) attends with the step's pattern.
* ``paged``: ``PagedKVCache.update_blocks`` and the ``paged`` backend, which reads each
  group of equal-length rows' blocks and runs torch's fused kernel without a mask.
* floor: the bytes of keys/values the step must read (the rows' stored tokens), over the
  memory bandwidth measured in the same run (a ``sum`` over a 512 MiB tensor).

Rows are either all ``C`` tokens long (``uniform``) or drawn uniformly in ``C/2..C``
(``mixed``, seed 0: the gather path pads to the longest). The two paths alternate, best
of ``--rounds`` after a warm-up. ``auto``'s choice for each cell is printed beside the
measured winner.

Usage::

    python benchmarks/paged_attention.py [--batches 8 32] [--contexts 512 1024 2048 4096]
        [--rounds 5] [--update-docs]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line, write_section
from attnlab.backends import AttentionCall, choose_call, dispatch_trusted
from attnlab.cache import PagedKVPool
from attnlab.functional.masks import causal, padding

HEADING = "## Paged decode attention: block tables vs gather (issue 10)"
H, H_KV, D, BS = 8, 2, 64, 16


def _bandwidth() -> float:
    """Bytes per second a ``sum`` reads from a tensor well beyond the caches."""
    x = torch.ones(128 * 1024 * 1024)  # 512 MiB
    x.sum()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def _setup(b: int, lengths: list[int]) -> tuple[PagedKVPool, dict]:
    total_blocks = sum(-(-(n + 1) // BS) for n in lengths) + 1
    pool = PagedKVPool(
        num_layers=1, num_kv_heads=H_KV, head_dim=D, num_blocks=total_blocks, block_size=BS
    )
    torch.manual_seed(0)
    pool.keys[0].normal_()
    pool.values[0].normal_()
    for r, n in enumerate(lengths):
        pool.add_sequence(r, list(range(n)))
    # blocks handed out a block at a time across rows, as decoding appends them
    for i in range(max(-(-n // BS) for n in lengths)):
        for r, n in enumerate(lengths):
            if i * BS < n:
                pool.reserve(r, min(BS, n - i * BS))
    for r, n in enumerate(lengths):
        seq = pool.seqs[r]
        seq.computed = n
        pool.append_tokens(r, [0])
        pool.reserve(r, 1)
    step = pool.begin_step([(r, 1) for r in range(b)])
    t = step.total
    pattern = causal() if step.attention_mask is None else causal() & padding(step.attention_mask)
    q_pos = torch.arange(t - 1, t)[None]
    k_pos = torch.arange(t)[None]
    call = AttentionCall(
        query_shape=(b, H, 1, D),
        key_shape=(b, H_KV, t, D),
        value_shape=(b, H_KV, t, D),
        dtype=torch.float32,
        device=torch.device("cpu"),
        mask="pattern",
        pattern=pattern,
        is_causal=False,
        dropout_p=0.0,
        enable_gqa=True,
        needs_grad=False,
        return_weights=False,
        positions=True,
        block_size=BS,
    )
    gather_call = dataclasses.replace(call, block_size=0)
    return pool, {"call": call, "gather_call": gather_call, "q_pos": q_pos, "k_pos": k_pos}


def _cell(b: int, lengths: list[int], rounds: int, bw: float) -> dict:
    pool, s = _setup(b, lengths)
    cache = pool.layers[0]
    q = torch.randn(b, H, 1, D)
    k_new, v_new = torch.randn(b, H_KV, 1, D), torch.randn(b, H_KV, 1, D)
    start = pool.step.start  # type: ignore[union-attr]
    gather_backend = choose_call(s["gather_call"]).chosen
    auto = choose_call(s["call"])

    def gather() -> torch.Tensor:
        k, v = cache.update(k_new, v_new, start=start)
        return dispatch_trusted(
            s["call"],
            q,
            k,
            v,
            backend=gather_backend,
            q_positions=s["q_pos"],
            k_positions=s["k_pos"],
        )[0]

    def paged() -> torch.Tensor:
        kp, vp, table = cache.update_blocks(k_new, v_new, start=start)
        return dispatch_trusted(
            s["call"], q, kp, vp, backend="paged", q_positions=s["q_pos"], block_table=table
        )[0]

    with torch.inference_mode():
        torch.testing.assert_close(paged(), gather(), atol=1e-5, rtol=1e-5)
        times = {"gather": float("inf"), "paged": float("inf")}
        for _ in range(rounds):
            for name, fn in (("gather", gather), ("paged", paged)):
                t = time.perf_counter()
                fn()
                times[name] = min(times[name], time.perf_counter() - t)
    nbytes = sum(lengths) * H_KV * 2 * D * 4
    return {
        "gather": times["gather"],
        "paged": times["paged"],
        "floor": nbytes / bw,
        "gather_backend": gather_backend,
        "auto": auto.chosen,
        "mib": nbytes / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: see below)")
    ap.add_argument("--update-docs", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bw = _bandwidth()
    rows = []
    rng = random.Random(0)
    for b in args.batches:
        for c in args.contexts:
            for kind in ("uniform", "mixed"):
                lengths = (
                    [c] * b if kind == "uniform" else [rng.randint(c // 2, c) for _ in range(b)]
                )
                r = _cell(b, lengths, args.rounds, bw)
                line = (
                    f"| {b} | {c} | {kind} | {r['mib']:.0f} | {r['gather'] * 1e3:.2f} "
                    f"({r['gather_backend']}) | {r['paged'] * 1e3:.2f} | "
                    f"{r['gather'] / r['paged']:.2f}x | {r['floor'] * 1e3:.2f} | "
                    f"{r['paged'] / r['floor']:.1f}x | {r['auto']} |"
                )
                print(line, flush=True)
                rows.append(line)
    body = "\n".join(
        [
            f"Machine: {machine_line()}; memory bandwidth measured in the run: "
            f"{bw / 1e9:.1f} GB/s (a `sum` over 512 MiB). The machine was shared with other "
            "engineers' jobs (2 cores, load average 8-11): one torch thread, so that a descheduled "
            "thread does not stall every kernel call; ratios are from one run, the paths alternating.",
            "",
            "Command: `python benchmarks/paged_attention.py --update-docs`",
            "",
            "One decode step of one attention layer (8 heads, 2 key/value heads, head dim 64, "
            "float32, blocks of 16 interleaved across rows). Times in ms, best of "
            f"{args.rounds}; floor = K/V bytes of the stored tokens / bandwidth.",
            "",
            "| batch | context | rows | K/V MiB | gather (backend) | paged | gather/paged "
            "| floor | paged/floor | auto picks |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    print(body)
    if args.update_docs:
        write_section(HEADING, body)


if __name__ == "__main__":
    main()
