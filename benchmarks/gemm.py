"""Float linears at few rows: attnlab's measured choice against ``F.linear`` and the floor (issues 21, 23).

For each weight shape of SmolLM2-135M (576->576, 576->192 (k/v), 576->1536, 1536->576,
the 576->49152 head) and of the 4-layer random Llama (hidden 256, intermediate 1024, the
256->32000 head of the serving and decode benchmarks), at 1, 2, 4, 8, 16 and 32 rows and
at each ``--threads`` count, float32: every kernel of :mod:`attnlab.backends.linear_pack`
(``F.linear``, ``x @ Wt`` contiguous, MKL's packed GEMM, oneDNN's prepacked inner product)
is timed over copies of the weight that exceed the L2 cache (as ``auto`` measures), and
the table gives ``F.linear``, attnlab's choice, their ratio, and the floor: the weight's
bytes over the copy bandwidth measured here (a 256 MiB ``copy_``, read + write counted).
The peer is ``F.linear`` (what transformers and attnlab ran before); vLLM's own oneDNN
handle is an extension of its build, not callable from this torch.

The fused shapes (``--shapes smollm2_fused llama_fused``) are q/k/v and gate/up stacked
along the output features (:mod:`attnlab.models.fuse`: 576->960 and 576->3072 for SmolLM2,
256->768 and 256->2048 for the 4-layer Llama); the step tables then put each model's step
summed over its separate matmuls (7 per layer + the head) beside the same step over the
fused ones (4 per layer + the head), each at attnlab's choice per shape.

Usage::

    PYTHONPATH=src python benchmarks/gemm.py [--threads 1 2] [--rows 1 2 4 8 16 32]
        [--shapes smollm2 llama smollm2_fused llama_fused]
"""

from __future__ import annotations

import argparse
import subprocess
import time

import torch

from attnlab.backends import linear_pack as lp

SHAPES = {
    "smollm2": [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)],
    "llama": [(256, 256), (1024, 256), (256, 1024), (32000, 256)],
    "smollm2_fused": [(960, 576), (3072, 576)],
    "llama_fused": [(768, 256), (2048, 256)],
}
#: how often each model's step multiplies each shape, separate and fused: SmolLM2's 30 layers
#: (q and o, k and v, gate and up, down; the head), the 4-layer Llama (q, k, v, o; gate, up;
#: down; the head); fused: q/k/v and gate/up one matmul each
PER_STEP = {
    "smollm2": {(576, 576): 60, (192, 576): 60, (1536, 576): 60, (576, 1536): 30, (49152, 576): 1},
    "llama": {(256, 256): 16, (1024, 256): 8, (256, 1024): 4, (32000, 256): 1},
    "smollm2_fused": {
        (960, 576): 30,
        (576, 576): 30,
        (3072, 576): 30,
        (576, 1536): 30,
        (49152, 576): 1,
    },
    "llama_fused": {(768, 256): 4, (256, 256): 4, (2048, 256): 4, (256, 1024): 4, (32000, 256): 1},
}


def bandwidth() -> float:
    """Copy bandwidth, bytes/s (read + write), best of 5."""
    a = torch.empty(64 << 20)
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return 2 * a.numel() * 4 / best


def flags() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    line = next((x for x in out.splitlines() if x.startswith("Flags")), "")
    keep = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
    return " ".join(f for f in line.split() if f in keep)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument(
        "--shapes",
        nargs="+",
        choices=sorted(SHAPES),
        default=["smollm2", "llama", "smollm2_fused", "llama_fused"],
    )
    args = ap.parse_args()
    names = [k for k in lp.GEMM_KERNELS if lp.gemm_unavailable(k, torch.float32) is None]
    print(f"torch {torch.__version__}; lscpu flags: {flags()}; kernels: {', '.join(names)}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        bw = bandwidth()
        print(f"\n### {threads} thread(s), copy bandwidth {bw / 1e9:.1f} GB/s\n")
        print("| weight [N, K] | rows | F.linear us | choice | choice us | speed-up | floor us |")
        print("|---|---|---|---|---|---|---|")
        times: dict[tuple[int, int, int], tuple[float, float, float]] = {}
        shapes = {shape for m in args.shapes for shape in SHAPES[m]}
        for m in args.shapes:  # every shape the step tables sum (a fused model's separate ones)
            shapes |= set(PER_STEP[m]) | set(PER_STEP[m.removesuffix("_fused")])
        for n, k in sorted(shapes):
            for r in args.rows:
                t = lp._measure(n, k, r, torch.float32, False, names)
                best = min(t, key=lambda x: t[x])
                floor = n * k * 4 / bw * 1e6
                times[(n, k, r)] = (t["linear"], t[best], floor)
                print(
                    f"| [{n}, {k}] | {r} | {t['linear']:.0f} | {best} | "
                    f"{t[best]:.0f} | {t['linear'] / t[best]:.2f}x | {floor:.0f} |"
                )
        step_tables(args.shapes, args.rows, times)


def step_tables(
    models: list[str], rows: list[int], times: dict[tuple[int, int, int], tuple[float, ...]]
) -> None:
    """Each model's step summed over its matmuls, ms (separate, and fused where asked)."""
    base = sorted({m.removesuffix("_fused") for m in models})
    for model in base:
        fused = f"{model}_fused" in models

        def total(name: str, r: int, col: int) -> float:
            return sum(c * times[(n, k, r)][col] for (n, k), c in PER_STEP[name].items()) / 1e3

        print(f"\n{model}'s step (every matmul once at the step's rows), ms:\n")
        head = "| rows | F.linear | attnlab's choices | speed-up | floor |"
        print(head + (" fused, choices | fused / separate |" if fused else ""))
        print("|---|---|---|---|---|" + ("---|---|" if fused else ""))
        for r in rows:
            a, b, f = (total(model, r, c) for c in range(3))
            line = f"| {r} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {f:.2f} |"
            if fused:
                fb = total(f"{model}_fused", r, 1)
                line += f" {fb:.2f} | {b / fb:.2f}x |"
            print(line)


if __name__ == "__main__":
    main()
