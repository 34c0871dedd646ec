"""What ``backend="auto"`` adds to one attention call, against torch's own sdpa (issue 8).

A repeated call signature (what a decode loop makes): small tensors, so the time is
the call's overhead, not arithmetic. The peer is ``torch.nn.functional.
scaled_dot_product_attention`` on the same tensors; the two are timed alternately, in
rounds of ``--calls`` calls, and the median of the rounds is reported with the
difference (the target: attnlab adds <= 20 us per call). Cases: no mask, ``is_causal``,
and a decode step (one query over a growing cache, bucketed memo key), each through the
public call (the backend chosen per call, memoized); and the decode step through the
model's path (issue 21): a plan built once per forward (``make_plan``, the backend chosen
then) and each layer's call ``attend(plan, query, KVView(key, value))``.

Usage::

    PYTHONPATH=src python benchmarks/dispatch.py [--rounds 15] [--calls 400]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from attnlab import scaled_dot_product_attention
from attnlab.backends.call import AttentionCall
from attnlab.backends.dispatch import attend
from attnlab.backends.plan import KVView, make_plan


def _per_call(fn: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 16, 64, generator=g)
    k = torch.randn(1, 8, 16, 64, generator=g)
    v = torch.randn(1, 8, 16, 64, generator=g)
    q1 = torch.randn(1, 8, 1, 64, generator=g)
    kc = torch.randn(1, 8, 300, 64, generator=g)
    vc = torch.randn(1, 8, 300, 64, generator=g)
    cases: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "no mask, (1, 8, 16, 64)": (
            lambda: F.scaled_dot_product_attention(q, k, v),
            lambda: scaled_dot_product_attention(q, k, v),
        ),
        "is_causal, (1, 8, 16, 64)": (
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            lambda: scaled_dot_product_attention(q, k, v, is_causal=True),
        ),
        "decode step, 1 query over 300 keys": (
            lambda: F.scaled_dot_product_attention(q1, kc, vc),
            lambda: scaled_dot_product_attention(q1, kc, vc),
        ),
        "decode step through a plan (the model's path)": (
            lambda: F.scaled_dot_product_attention(q1, kc, vc),
            lambda: attend(plan, q1, KVView(kc, vc)),
        ),
    }
    call = AttentionCall.from_inputs(
        q1, kc, vc, None, dropout_p=0.0, is_causal=False, enable_gqa=False, return_weights=False
    )
    plan = make_plan(call)  # once per forward; every layer's call reuses it
    print(f"plan backend: {plan.backend.name}")
    print("| case | torch sdpa, us | attnlab auto, us | added, us | ratio |")
    print("|---|---|---|---|---|")
    with torch.no_grad():
        for name, (peer, ours) in cases.items():
            for fn in (peer, ours):  # warm up (and fill the memo)
                _per_call(fn, 50)
            t_peer, t_ours = [], []
            for _ in range(args.rounds):
                t_peer.append(_per_call(peer, args.calls))
                t_ours.append(_per_call(ours, args.calls))
            p, o = statistics.median(t_peer) * 1e6, statistics.median(t_ours) * 1e6
            print(f"| {name} | {p:.1f} | {o:.1f} | {o - p:.1f} | {o / p:.2f} |")


if __name__ == "__main__":
    main()
