"""One-row quantized matmuls (a decode step's shapes): attnlab's ``fused`` kernel (float32
activations), ``q8dot`` and ``q8tile`` (int8 activation blocks, as llama.cpp; ``q8tile``
over weights interleaved in tiles of 16 features, AVX-512 VNNI builds) against torch's
``int4pack`` and ``int8groups`` (bfloat16 activations), SmolLM2-135M's shapes.

Each layer is quantized from random weights (Q4_1 = ``int4:g32``, Q8_0 = ``int8:g32``); the
fused kernel's error against a float64 dequantize-then-multiply is printed with its time.

``--sequence`` times a whole decode step's worth of distinct matrices instead (30 layers of
SmolLM2's 7 shapes and the 49152-row head, random levels, float16-exact scales as in a
GGUF file), so the weights stream from memory as in decoding, per kernel and file type.

Usage::

    python benchmarks/qgemv.py --threads 1
    python benchmarks/qgemv.py --threads 2 --sequence
    python benchmarks/qgemv.py --threads 2 --sequence --fused    # q/k/v, gate/up joined

``--sequence`` also prints each shape's time per call inside the sequence against its
bytes over the copy bandwidth of a 256 MiB buffer (the floor of ``benchmarks/llamacpp.py``).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]  # N x K


def best_us(fn: Callable[[], object], n: int = 50) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
# the same layer with q/k/v and gate/up joined (modules.quant_concat): 4 calls instead of 7
FUSED = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def bandwidth_gbs() -> float:
    """Copy bandwidth of a 256 MiB buffer (read + write), GB/s (as benchmarks/llamacpp.py)."""
    a = torch.empty(64 * 2**20)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.numel() * 4 / best / 1e9


def sequence(rows: int, bw: float | None = None, layer: list[tuple[int, int]] = LAYER) -> None:
    """ms per token of 211 distinct one-row matmuls (cold weights), q8dot against q8tile,
    and (``bw``: the copy bandwidth, GB/s) each shape's time per call inside the sequence."""
    from attnlab.backends.qmatmul_cpu import qgemv_q8, qgemv_q8t, tile_weights, tiled_unavailable

    gen = torch.Generator().manual_seed(0)
    for kind in ("Q8_0", "Q4_1"):
        mats = []
        for n, k in layer * 30 + [(49152, 576)]:
            s = (torch.rand(n, k // 32, generator=gen) * 0.01).half().float()
            if kind == "Q8_0":
                q, m = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen), None
            else:
                q, m = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen), -8 * s
            mats.append((n, k, q, s, m))
        x = {k: torch.randn(rows, k) for k in (576, 1536)}
        calls = {"q8dot": [functools.partial(qgemv_q8, x[k], q, s, m, 32)
                           for n, k, q, s, m in mats]}  # fmt: skip
        if tiled_unavailable() is None:
            calls["q8tile"] = [functools.partial(qgemv_q8t, x[k], *tile_weights(q, s, m, 32), n)
                               for n, k, q, s, m in mats]  # fmt: skip
        mb = sum(q.numel() * q.element_size() + s.numel() * 2 * (2 if m is not None else 1)
                 for _, _, q, s, m in mats) / 1e6  # fmt: skip
        best = dict.fromkeys(calls, float("inf"))
        shapes = sorted({(n, k) for n, k, *_ in mats}, key=lambda nk: nk[0] * nk[1])
        per = {name: {nk: float("inf") for nk in shapes} for name in calls}  # s per call
        for _ in range(8):  # alternating rounds
            for name, fns in calls.items():
                spent = dict.fromkeys(shapes, 0.0)
                t0 = time.perf_counter()
                for fn, (n, k, *_) in zip(fns, mats, strict=True):
                    t1 = time.perf_counter()
                    fn()
                    spent[(n, k)] += time.perf_counter() - t1
                best[name] = min(best[name], time.perf_counter() - t0)
                for nk, v in spent.items():
                    calls_nk = sum(1 for n, k, *_ in mats if (n, k) == nk)
                    per[name][nk] = min(per[name][nk], v / calls_nk)
        print(f"{kind}, {rows} row(s), {mb:.0f} MB of GGUF weights a token: "
              + ", ".join(f"{k} {v * 1e3:.2f} ms ({mb / 1e3 / v:.1f} GB/s)"
                          for k, v in best.items()), flush=True)  # fmt: skip
        if bw is not None:  # each shape's call against its bytes over the copy bandwidth
            for n, k in shapes:
                nbytes = n * k * (1 if kind == "Q8_0" else 0.5) + n * k // 32 * (
                    2 if kind == "Q8_0" else 4
                )
                floor_us = nbytes / (bw * 1e9) * 1e6
                print(f"  {n} x {k} ({nbytes / 1e3:.0f} kB): "
                      + ", ".join(f"{name} {per[name][(n, k)] * 1e6:.1f} us "
                                  f"({nbytes / per[name][(n, k)] / 1e9:.1f} GB/s)"
                                  for name in calls)
                      + f"; floor {floor_us:.1f} us at {bw:.1f} GB/s", flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sequence", action="store_true", help="a decode step's distinct matrices")
    p.add_argument("--rows", type=int, default=1, help="rows of activations (--sequence)")
    p.add_argument(
        "--fused",
        action="store_true",
        help="--sequence with q/k/v and gate/up joined: 121 calls a token instead of 211",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.sequence:
        bw = bandwidth_gbs()
        print(f"{torch.get_num_threads()} thread(s), copy bandwidth {bw:.1f} GB/s")
        sequence(args.rows, bw, FUSED if args.fused else LAYER)
        return
    from attnlab.backends.qmatmul import KERNELS
    from attnlab.backends.qmatmul_cpu import (
        int8_dot,
        qgemv,
        qgemv_q8,
        qgemv_q8t,
        repack_int4,
        tile_weights,
        tiled_unavailable,
        unavailable,
    )
    from attnlab.modules.quant_linear import Int4Linear, Int8Linear

    why = unavailable()
    if why is not None:
        raise SystemExit(f"the fused kernel is not available: {why}")
    print(f"{torch.get_num_threads()} thread(s); microseconds per call, one row; "
          f"q8dot's int8 dot: {int8_dot()}")  # fmt: skip
    for n, k in SHAPES:
        lin = torch.nn.Linear(k, n, bias=False)
        l4 = Int4Linear.from_float(lin, group_size=32)
        l8 = Int8Linear.from_float(lin, group_size=32)
        x = torch.randn(1, k)
        xb = x.bfloat16()
        q4 = repack_int4(l4.levels())
        with torch.no_grad():
            err4 = (qgemv(x, q4, l4.scales, l4.mins, 32).double()
                    - x.double() @ l4.dequantize(torch.float64).T).abs().max()  # fmt: skip
            err8 = (qgemv(x, l8.qweight, l8.scales, None, 32).double()
                    - x.double() @ l8.dequantize(torch.float64).T).abs().max()  # fmt: skip
            f4 = best_us(functools.partial(qgemv, x, q4, l4.scales, l4.mins, 32))
            f8 = best_us(functools.partial(qgemv, x, l8.qweight, l8.scales, None, 32))
            d4 = best_us(functools.partial(qgemv_q8, x, q4, l4.scales, l4.mins, 32))
            d8 = best_us(functools.partial(qgemv_q8, x, l8.qweight, l8.scales, None, 32))
            tiled = ""
            if tiled_unavailable() is None:
                t4 = best_us(
                    functools.partial(qgemv_q8t, x, *tile_weights(q4, l4.scales, l4.mins, 32), n)
                )
                t8 = best_us(
                    functools.partial(
                        qgemv_q8t, x, *tile_weights(l8.qweight, l8.scales, None, 32), n
                    )
                )
                tiled = f", q8tile Q4 {t4:.0f}, q8tile Q8_0 {t8:.0f}"
            i4 = best_us(functools.partial(KERNELS["int4pack"].run, l4, xb))
            i8 = best_us(functools.partial(KERNELS["int8groups"].run, l8, xb))
        print(f"{n} x {k}: fused Q4 {f4:.0f} (err {float(err4):.1e}), fused Q8_0 {f8:.0f} "
              f"(err {float(err8):.1e}), q8dot Q4 {d4:.0f}, q8dot Q8_0 {d8:.0f}{tiled}, "
              f"int4pack bf16 {i4:.0f}, int8groups bf16 {i8:.0f}",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
