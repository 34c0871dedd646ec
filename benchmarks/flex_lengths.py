"""FlexAttention over many distinct lengths: peak memory, fused or not (issue 8).

A model sees a new sequence length on nearly every call. With one static
``torch.compile`` object (what the ``flex`` backend did before issue 8), dynamo stops
compiling after 8 shapes and runs FlexAttention uncompiled, which materialises the
score matrix. This script calls attention with a causal sliding window on ``--lengths``
distinct lengths ending at ``--seq-len`` and reports the process's peak resident memory
after the first 8 calls and after all of them, for two peers, each in a fresh
subprocess (glibc keeps freed buffers, so one process per peer):

* ``static``: ``torch.compile(flex_attention, dynamic=False)`` called directly, as the
  backend did before;
* ``attnlab``: ``scaled_dot_product_attention(..., backend="flex")`` now (one kernel
  family, lengths dynamic after the first).

The floor is the bytes the call must hold: q, k, v and the output in float32.

Usage::

    PYTHONPATH=src python benchmarks/flex_lengths.py [--seq-len 4096] [--window 512] \
        [--lengths 16] [--heads 12] [--head-dim 64]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _lengths(seq_len: int, count: int) -> list[int]:
    return [seq_len - 64 * i for i in range(count - 1, -1, -1)]


def _child(peer: str, args: argparse.Namespace) -> None:
    """Run one peer in this process and print its figures as one JSON line."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from attnlab import scaled_dot_product_attention
    from attnlab.functional import masks as M

    torch.set_num_threads(args.threads)
    pattern = M.sliding_window(args.window - 1)
    static = torch.compile(flex_attention, dynamic=False)
    w = args.window - 1

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> torch.Tensor:
        return (k <= q) & (q - k <= w)

    start = _rss_mib()
    after: dict[int, float] = {}
    seconds: list[float] = []
    for i, n in enumerate(_lengths(args.seq_len, args.lengths)):
        q, k, v = (torch.randn(1, args.heads, n, args.head_dim) for _ in range(3))
        t0 = time.perf_counter()
        if peer == "static":
            bm = create_block_mask(mask_mod, None, None, n, n, device="cpu")
            static(q, k, v, block_mask=bm)
        else:
            scaled_dot_product_attention(q, k, v, pattern, is_causal=True, backend="flex")
        seconds.append(time.perf_counter() - t0)
        after[i + 1] = _rss_mib()
    out = {"start": start, "after8": after[min(8, len(after))], "end": after[len(after)]}
    out["last_s"] = seconds[-1]
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--lengths", type=int, default=16)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", choices=("static", "attnlab"))
    args = parser.parse_args()
    if args.child:
        _child(args.child, args)
        return
    floor = 4 * args.heads * args.seq_len * args.head_dim * 4 / 2**20
    lengths = _lengths(args.seq_len, args.lengths)
    print(
        f"{args.lengths} lengths {lengths[0]}..{lengths[-1]}, window {args.window}, "
        f"{args.heads} heads x {args.head_dim}, float32; floor (q, k, v, out) {floor:.0f} MiB"
    )
    print(
        f"{'peer':<8} {'rss start':>10} {'after 8':>10} {'after all':>10} {'growth':>10} {'last call':>10}"
    )
    for peer in ("static", "attnlab"):
        cmd = [sys.executable, __file__, "--child", peer] + [
            f"--{k.replace('_', '-')}={getattr(args, k)}"
            for k in ("seq_len", "window", "lengths", "heads", "head_dim", "threads")
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            print(
                f"{peer:<8} failed (exit {res.returncode}): {res.stderr.strip().splitlines()[-1:]}"
            )
            continue
        r = json.loads(res.stdout.strip().splitlines()[-1])
        print(
            f"{peer:<8} {r['start']:>7.0f} MiB {r['after8']:>6.0f} MiB {r['end']:>6.0f} MiB "
            f"{r['end'] - r['after8']:>+6.0f} MiB {1000 * r['last_s']:>7.0f} ms"
        )


if __name__ == "__main__":
    main()
