"""One-row quantized matmuls (a decode step's shapes): attnlab's ``fused`` kernel (float32
activations) and ``q8dot`` (int8 activation blocks, as llama.cpp) against torch's
``int4pack`` and ``int8groups`` (bfloat16 activations), SmolLM2-135M's shapes.

Each layer is quantized from random weights (Q4_1 = ``int4:g32``, Q8_0 = ``int8:g32``); the
fused kernel's error against a float64 dequantize-then-multiply is printed with its time.

Usage::

    python benchmarks/qgemv.py --threads 1
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from attnlab.backends.qmatmul import KERNELS
    from attnlab.backends.qmatmul_cpu import int8_dot, qgemv, qgemv_q8, repack_int4, unavailable
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
            i4 = best_us(functools.partial(KERNELS["int4pack"].run, l4, xb))
            i8 = best_us(functools.partial(KERNELS["int8groups"].run, l8, xb))
        print(f"{n} x {k}: fused Q4 {f4:.0f} (err {float(err4):.1e}), fused Q8_0 {f8:.0f} "
              f"(err {float(err8):.1e}), q8dot Q4 {d4:.0f}, q8dot Q8_0 {d8:.0f}, "
              f"int4pack bf16 {i4:.0f}, int8groups bf16 {i8:.0f}",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
