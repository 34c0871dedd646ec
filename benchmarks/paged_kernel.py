"""The ``paged_kernel`` C++ kernel against the block copy + torch's flash kernel and the floor.

One attention layer of SmolLM2-135M (9 query heads, 3 key/value heads, head dim 64,
float32) over a paged pool (blocks of 16 tokens handed out interleaved across rows, as
a serving engine's decode appends them), every row ``C`` tokens long:

* decode: ``B`` rows of one query each at the newest slot (a serving decode step);
* chunk: ``B`` rows of ``Lq`` queries each, causal, at the newest ``Lq`` slots of ``C``
  (``C = Lq``: a first prefill chunk; ``C > Lq``: a chunk after cached tokens).

Paths, alternating, best of ``--rounds`` after a warm-up (one thread):

* ``kernel``: ``paged_kernel`` (``csrc/paged_attention.cpp``), the widest SIMD path of
  the build; ``kernel/8`` and ``kernel/1`` (decode only): its AVX2 and scalar paths;
* ``copy+flash``: the ``paged`` backend: each row's blocks copied out, then torch's
  fused (flash) CPU kernel;
* floor (decode): a ``sum`` over as many bytes as the step's keys and values, warm as
  the pool is (the bandwidth of a ``sum`` over 512 MiB, beyond the caches, is printed
  too); (chunk) the bare matmuls of the same
  attention, ``Q K^T`` and ``P V`` over the whole ``[Lq, C]`` rectangle, as one
  batched matmul each (half of it is masked off by the causal pattern).

``auto`` names the backend it picks for each cell (by the cost constants, ``KERNEL_*``
in ``backends/paged_kernel.py``), beside the measured winner.

Usage::

    PYTHONPATH=src python benchmarks/paged_kernel.py [--rounds 20] [--update-docs]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line, write_section
from attnlab.backends import AttentionCall, choose_call, native
from attnlab.backends.paged import paged_attention
from attnlab.backends.paged_kernel import paged_kernel_attention
from attnlab.backends.plan import BlockTable
from attnlab.functional.masks import causal
from paged_attention import _bandwidth

HEADING = "## Paged attention kernel: SIMD decode and GEMM chunks against copy + flash (issue 21)"
H, H_KV, D, BS = 9, 3, 64, 16


def _cell(b: int, context: int, lq: int) -> dict:
    nb = -(-context // BS)
    g = torch.Generator().manual_seed(0)
    kp = torch.randn(b * nb * BS + BS, H_KV, D, generator=g)
    vp = torch.randn(b * nb * BS + BS, H_KV, D, generator=g)
    table = torch.arange(b * nb).view(nb, b).t().contiguous()  # interleaved across rows
    blocks = BlockTable(table, BS, (context,) * b, (0,) * b, (0,) * b)
    q = torch.randn(b, H, lq, D, generator=g)
    q_pos = torch.arange(context - lq, context)[None]
    call = AttentionCall(
        query_shape=(b, H, lq, D),
        key_shape=(b, H_KV, context, D),
        value_shape=(b, H_KV, context, D),
        dtype=torch.float32,
        device=torch.device("cpu"),
        mask="pattern",
        pattern=causal(),
        is_causal=False,
        dropout_p=0.0,
        enable_gqa=True,
        needs_grad=False,
        return_weights=False,
        positions=True,
        block_size=BS,
    )
    return {"kp": kp, "vp": vp, "blocks": blocks, "q": q, "q_pos": q_pos, "call": call}


def _paths(c: dict, widths: bool) -> dict[str, Callable[[], torch.Tensor]]:
    q, kp, vp, blocks, q_pos = c["q"], c["kp"], c["vp"], c["blocks"], c["q_pos"]
    meta = torch.tensor([[n, 0, 0] for n in blocks.lengths])
    op = torch.ops.attnlab_paged

    def kernel() -> torch.Tensor:
        return paged_kernel_attention(q, kp, vp, causal(), q_positions=q_pos, block_table=blocks)[0]

    def copy_flash() -> torch.Tensor:
        return paged_attention(
            q, kp, vp, causal(), enable_gqa=True, q_positions=q_pos, block_table=blocks
        )[0]

    def width(w: int) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            out = torch.empty(q.shape[0], H, q.shape[2], D)
            pos = q_pos.expand(q.shape[0], -1)
            op.paged_attention_simd(q, kp, vp, blocks.table, pos, meta, D**-0.5, -1, BS, out, w)
            return out

        return run

    paths = {"kernel": kernel, "copy+flash": copy_flash}
    if widths:
        for w in op.simd_widths()[1:]:
            paths[f"kernel/{w}"] = width(w)
    return paths


def _best(paths: dict[str, Callable[[], torch.Tensor]], rounds: int) -> dict[str, float]:
    with torch.inference_mode():
        ref = paths["copy+flash"]()
        for name, fn in paths.items():  # every path computes the same attention
            torch.testing.assert_close(fn(), ref, atol=1e-4, rtol=1e-4, msg=name)
        best = dict.fromkeys(paths, float("inf"))
        for _ in range(rounds):
            for name, fn in paths.items():
                t = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t)
    return best


def _bytes_floor(numel: int, rounds: int) -> float:
    """A ``sum`` over as many float32 bytes as the step reads (warm, like the pool)."""
    x = torch.randn(numel)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return best


def _matmul_floor(b: int, context: int, lq: int, rounds: int) -> float:
    q = torch.randn(b * H_KV, lq * (H // H_KV), D)
    k = torch.randn(b * H_KV, context, D)
    p = torch.randn(b * H_KV, lq * (H // H_KV), context)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        torch.bmm(q, k.transpose(1, 2))
        torch.bmm(p, k)
        best = min(best, time.perf_counter() - t)
    return best


def _row(kind: str, b: int, context: int, lq: int, best: dict, floor: float, c: dict) -> str:
    auto = choose_call(c["call"])
    kern, copy = best["kernel"], best["copy+flash"]
    extra = " / ".join(f"{best[k] * 1e3:.2f}" for k in best if k.startswith("kernel/"))
    return (
        f"| {kind} | {b} | {context} | {lq} | {kern * 1e3:.3f} | {extra or '-'} | "
        f"{copy * 1e3:.3f} | {copy / kern:.2f}x | {floor * 1e3:.3f} | {kern / floor:.1f}x | "
        f"{'kernel' if kern < copy else 'copy+flash'} | {auto.chosen} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[160, 256, 512, 1024])
    ap.add_argument("--chunks", nargs="+", default=["8x128x128", "8x128x512", "1x512x512"],
                    help="ROWSxQUERIESxCONTEXT prefill chunks")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--update-docs", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    reason = native.paged_status()
    if reason is not None:
        raise SystemExit(f"the paged_kernel is unavailable here: {reason}")
    load = lambda: Path("/proc/loadavg").read_text().split()[0]  # noqa: E731
    start = (time.strftime("%H:%M", time.gmtime()), load())
    bw = _bandwidth()
    rows = []
    for b in args.batches:
        for ctx in args.contexts:
            c = _cell(b, ctx, 1)
            best = _best(_paths(c, widths=True), args.rounds)
            floor = _bytes_floor(b * ctx * H_KV * 2 * D, args.rounds)
            rows.append(_row("decode", b, ctx, 1, best, floor, c))
            print(rows[-1], flush=True)
    for spec in args.chunks:
        b, lq, ctx = (int(x) for x in spec.split("x"))
        c = _cell(b, ctx, lq)
        best = _best(_paths(c, widths=False), max(3, args.rounds // 4))
        floor = _matmul_floor(b, ctx, lq, max(3, args.rounds // 4))
        rows.append(_row("chunk", b, ctx, lq, best, floor, c))
        print(rows[-1], flush=True)
    end = (time.strftime("%H:%M", time.gmtime()), load())
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f" {f} " in flags]
    widths = list(torch.ops.attnlab_paged.simd_widths())
    body = "\n".join(
        [
            f"Machine: {machine_line()}; CPU flags: {' '.join(isa)}; the kernel's SIMD widths "
            f"in this build: {widths}; memory bandwidth measured in the run: {bw / 1e9:.1f} GB/s "
            f"(a `sum` over 512 MiB). {start[0]}-{end[0]} UTC, load average {start[1]} at the "
            f"start, {end[1]} at the end. Both paths one torch thread, alternating, best of "
            f"{args.rounds} (chunks: {max(3, args.rounds // 4)}).",
            "",
            "Command: `PYTHONPATH=src python benchmarks/paged_kernel.py --update-docs`",
            "",
            "One SmolLM2-135M attention layer (9 heads, 3 key/value heads, head dim 64, "
            "float32, blocks of 16 interleaved across rows, every row `context` tokens). "
            "Times in ms. Floor: decode, a `sum` over the K/V bytes the step reads; chunk, the bare "
            "`Q K^T` and `P V` batched matmuls over the whole rectangle.",
            "",
            "| step | rows | context | queries | kernel | kernel AVX2 / scalar | copy+flash "
            "| copy/kernel | floor | kernel/floor | faster | auto picks |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    print(body)
    if args.update_docs:
        write_section(HEADING, body)


if __name__ == "__main__":
    main()
