"""Attention backends: time and peak memory against sequence length (issue 4).

For each mask (dense causal; sliding window w = 512, i.e. ``sliding_window(511)``),
each pass (forward; forward + backward up to 8192) and each length (512 ... 32768),
every backend runs in a fresh subprocess (B = 1, 12 heads, head dim 64, float32),
which reports its median time and its peak extra memory (the peak resident size,
``VmHWM``, reset through ``/proc/self/clear_refs`` just before the first call, minus
the resident size then; glibc keeps freed buffers, so a fresh process per cell). The named peer is torch's own
``scaled_dot_product_attention``: ``is_causal=True`` for the causal mask, the same
window as a dense boolean mask for the sliding window. Ratios are against it.

Usage::

    PYTHONPATH=src python benchmarks/attention.py            # the full run (long)
    PYTHONPATH=src python benchmarks/attention.py --quick    # 512..2048, a smoke test
    PYTHONPATH=src python benchmarks/attention.py --calibrate  # constants for auto
    PYTHONPATH=src python benchmarks/attention.py --device cuda --calibrate  # on a GPU

The full run writes ``build/bench/attention.json``, the plot
``docs/attention_backends.png`` and its table into ``docs/benchmarks.md`` under
"## Attention backends (issue 4)".
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADS, HEAD_DIM, WINDOW = 12, 64, 512
BACKENDS = ["torch", "reference", "sdpa", "tiled", "sparse", "flex", "auto", "linear"]
LENGTHS = [512, 1024, 2048, 4096, 8192, 16384, 32768]
BWD_MAX = 8192
SECTION = "## Attention backends (issue 4)"


# --------------------------------------------------------------------- one cell


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> int:
    """Reset the peak resident size (Linux: ``5 > /proc/self/clear_refs``); return the current one."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status_bytes("VmRSS")


def run_cell(backend: str, mask: str, L: int, bwd: bool, reps: int) -> dict[str, float]:
    """Run one (backend, mask, length, pass) in this process; return time and memory."""
    import torch
    import torch.nn.functional as F

    from attnlab import scaled_dot_product_attention
    from attnlab.functional import masks

    if os.environ.get("ATTNLAB_BENCH_THREADS"):
        torch.set_num_threads(int(os.environ["ATTNLAB_BENCH_THREADS"]))
    device = torch.device(os.environ.get("ATTNLAB_BENCH_DEVICE", "cpu"))
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(1, HEADS, L, HEAD_DIM, device=device, requires_grad=bwd) for _ in range(3)
    )
    pattern = masks.sliding_window(WINDOW - 1) if mask == "window" else None
    dense = pattern.to_dense(L, L) if (backend == "torch" and pattern is not None) else None

    def call() -> torch.Tensor:
        if backend == "torch":
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=dense, is_causal=mask == "causal"
            )
        out = scaled_dot_product_attention(
            q, k, v, attn_mask=pattern, is_causal=mask == "causal", backend=backend
        )
        assert isinstance(out, torch.Tensor)
        return out

    def step() -> None:
        if bwd:
            call().sum().backward()
            for t in (q, k, v):
                t.grad = None
        else:
            with torch.no_grad():
                call()
        if cuda:
            torch.cuda.synchronize()

    if backend == "auto" and not bwd:
        # A long-running job has compiled flex for its shape after the first call;
        # without this, auto (rightly) avoids flex's ~15 s first-call compile.
        with torch.no_grad():
            scaled_dot_product_attention(
                q, k, v, attn_mask=pattern, is_causal=mask == "causal", backend="flex"
            )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _reset_peak()
    t0 = time.perf_counter()
    step()  # warm-up: compiles flex, sets the peak memory
    first = time.perf_counter() - t0
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _status_bytes("VmHWM") - base
        if backend == "flex":  # the compile's own memory is in the first call: measure again
            base = _reset_peak()
            step()
            peak = _status_bytes("VmHWM") - base
    times = [first]
    if first < 30:
        times = []
        for _ in range(reps if first < 2 else 1):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return {"seconds": min(times), "first": first, "peak_bytes": float(peak)}


def _subprocess_cell(backend: str, mask: str, L: int, bwd: bool, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--cell", backend, mask, str(L), "1" if bwd else "0"]
    env = dict(os.environ)
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / "build" / "inductor-cache"))
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout > {timeout:.0f} s"}
    if res.returncode != 0:
        tail = (res.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": f"exit {res.returncode}: {tail[:120]}"}
    return json.loads(res.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------- plans


def skip_reason(backend: str, mask: str, L: int, bwd: bool) -> str | None:
    """Cells not run, with the reason written into the table."""
    if backend == "reference" and L > 8192:
        return f"needs ~{3 * HEADS * L * L * 4 / 2**30:.0f} GiB"
    if backend == "torch" and mask == "window" and L > 16384:
        return "dense mask: O(L^2) time, > 60 s"
    if backend == "sdpa" and mask == "window" and L > 8192:
        return "same as torch + mask build"
    if backend == "flex" and bwd:
        return "CPU flex: inference only"
    if backend == "linear" and mask == "window":
        return "applies only causal/padding masks"
    if backend == "sparse" and mask == "causal" and L > 8192:
        return "O(L^2) gather, slow"
    return None


def matmul_gflops() -> float:
    import torch

    a, b = torch.randn(4096, 4096), torch.randn(4096, 4096)
    a @ b
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * 4096**3 / best / 1e9


def useful_flops(mask: str, L: int, bwd: bool) -> float:
    """Useful FLOPs: 4 * H * pairs * d forward (pairs attended), 2.5x more for the backward."""
    pairs = L * (L + 1) / 2 if mask == "causal" else sum(min(i + 1, WINDOW) for i in range(L))
    f = 4 * HEADS * pairs * HEAD_DIM
    return f * 3.5 if bwd else f


def full_run(lengths: list[int], backends: list[str], out_json: Path, timeout: float) -> dict:
    results: dict = {"matmul_gflops": matmul_gflops(), "cells": []}
    print(f"fp32 matmul 4096^3: {results['matmul_gflops']:.0f} GFLOP/s", flush=True)
    for mask in ("causal", "window"):
        for bwd in (False, True):
            for L in lengths:
                if bwd and L > BWD_MAX:
                    continue
                for backend in backends:
                    why = skip_reason(backend, mask, L, bwd)
                    cell = {"backend": backend, "mask": mask, "L": L, "bwd": bwd}
                    cell.update(
                        {"skipped": why}
                        if why
                        else _subprocess_cell(backend, mask, L, bwd, timeout)
                    )
                    results["cells"].append(cell)
                    print(json.dumps(cell), flush=True)
                    out_json.write_text(json.dumps(results, indent=1))
    return results


# ---------------------------------------------------------------------- report


def _fmt_ms(s: float) -> str:
    ms = s * 1e3
    return f"{ms:.0f}" if ms >= 10 else f"{ms:.1f}"


def report(results: dict) -> str:
    cells = results["cells"]
    mm = results["matmul_gflops"]
    lines = []
    backends = [b for b in BACKENDS if any(c["backend"] == b for c in cells)]
    for mask in ("causal", "window"):
        for bwd in (False, True):
            sel = [c for c in cells if c["mask"] == mask and c["bwd"] == bwd]
            if not sel:
                continue
            lengths = sorted({c["L"] for c in sel})
            peer = (
                "torch sdpa is_causal"
                if mask == "causal"
                else f"torch sdpa + dense bool window mask (w={WINDOW})"
            )
            title = "dense causal" if mask == "causal" else f"sliding window w={WINDOW}"
            lines += ["", f"### {title}, {'forward + backward' if bwd else 'forward'}", ""]
            lines += [f"Time in ms (ratio to {peer}); GFLOP/s = useful FLOPs / time.", ""]
            lines += ["| backend | " + " | ".join(str(L) for L in lengths) + " |"]
            lines += ["|---" * (len(lengths) + 1) + "|"]
            by = {(c["backend"], c["L"]): c for c in sel}
            for b in backends:
                row = [b if b != "torch" else "torch (peer)"]
                for L in lengths:
                    c = by.get((b, L))
                    peer_c = by.get(("torch", L))
                    if c is None:
                        row.append("")
                    elif "skipped" in c:
                        row.append(f"— ({c['skipped']})")
                    elif "error" in c:
                        row.append(f"✗ ({c['error'][:40]})")
                    else:
                        txt = _fmt_ms(c["seconds"])
                        if peer_c and "seconds" in peer_c and b != "torch":
                            txt += f" ({c['seconds'] / peer_c['seconds']:.2f}×)"
                        txt += f", {useful_flops(mask, L, bwd) / c['seconds'] / 1e9:.0f} GF/s"
                        row.append(txt)
                lines.append("| " + " | ".join(row) + " |")
            if not bwd:
                lines += [
                    "",
                    "Peak extra memory (MiB; `VmHWM` after a reset, fresh process per cell):",
                    "",
                ]
                lines += ["| backend | " + " | ".join(str(L) for L in lengths) + " |"]
                lines += ["|---" * (len(lengths) + 1) + "|"]
                for b in backends:
                    row = [b if b != "torch" else "torch (peer)"]
                    for L in lengths:
                        c = by.get((b, L))
                        row.append(
                            f"{c['peak_bytes'] / 2**20:.0f}" if c and "peak_bytes" in c else "—"
                        )
                    lines.append("| " + " | ".join(row) + " |")
    head = [
        f"fp32 matmul (4096³) on this machine: **{mm:.0f} GFLOP/s**, the limit to compare with.",
        "",
    ]
    return "\n".join(head + lines) + "\n"


def targets_table(res: dict) -> str:
    """The issue's targets from a ``--targets`` run, as a markdown table."""
    c, w16, w32 = res["causal_4096"], res["window_16384"], res["window_32768"]
    best16 = min(w16[b] for b in ("sparse", "flex"))
    best16_name = min(("sparse", "flex"), key=lambda b: w16[b])
    rows = [
        (
            "tiled causal 4096 within 1.5x of torch sdpa",
            f"tiled {c['tiled'] * 1e3:.0f} ms, torch {c['torch'] * 1e3:.0f} ms: "
            f"{c['tiled'] / c['torch']:.2f}x",
            c["tiled"] / c["torch"] <= 1.5,
        ),
        (
            "window w=512 at 16384: best of sparse/flex >= 10x faster than torch + dense mask",
            f"{best16_name} {best16 * 1e3:.0f} ms, torch {w16['torch'] * 1e3:.0f} ms: "
            f"{w16['torch'] / best16:.1f}x",
            w16["torch"] / best16 >= 10,
        ),
    ]
    for b in ("sparse", "flex", "tiled"):
        r = w32[b] / w16[b]
        label = f"{b}: time(32768) / time(16384) <= 2.2" + (
            " (not in the target)" if b == "tiled" else ""
        )
        rows.append((label, f"{w32[b]:.2f} s / {w16[b]:.2f} s = {r:.2f}", r <= 2.2))
    for name, cell in (("causal 4096", c), ("window 16384", w16), ("window 32768", w32)):
        best = min(v for k, v in cell.items() if k != "auto")
        who = min((k for k in cell if k != "auto"), key=lambda k: cell[k])
        rows.append(
            (
                f"auto within 1.1x of the best, {name}",
                f"auto {cell['auto'] * 1e3:.0f} ms, best {who} {best * 1e3:.0f} ms: {cell['auto'] / best:.2f}x",
                cell["auto"] / best <= 1.1,
            )
        )
    lines = ["| target | measured | met |", "|---|---|---|"]
    lines += [f"| {t} | {m} | {'yes' if ok else '**no**'} |" for t, m, ok in rows]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in results["cells"] if "seconds" in c]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, (mask, bwd, what) in zip(
        axes,
        [
            ("causal", False, "seconds"),
            ("window", False, "seconds"),
            ("window", False, "peak_bytes"),
        ],
    ):
        for b in BACKENDS:
            pts = sorted(
                (c["L"], c[what])
                for c in cells
                if c["backend"] == b and c["mask"] == mask and c["bwd"] == bwd
            )
            if pts:
                xs, ys = zip(*pts)
                ys = [y * 1e3 if what == "seconds" else y / 2**20 for y in ys]
                ax.loglog(xs, ys, marker="o", label=b if b != "torch" else "torch sdpa (peer)")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("ms" if what == "seconds" else "peak extra MiB")
        ax.set_title(
            f"{mask}, {'fwd+bwd' if bwd else 'fwd'}: {'time' if what == 'seconds' else 'memory'}"
        )
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_section(text: str, md: Path) -> None:
    doc = md.read_text()
    start = doc.index(SECTION) + len(SECTION)
    nxt = doc.find("\n## ", start)
    end = len(doc) if nxt < 0 else nxt + 1
    md.write_text(
        doc[:start] + "\n\n" + text.strip() + "\n" + ("\n" if nxt >= 0 else "") + doc[end:]
    )


# ------------------------------------------------------------------- calibrate


def _timed_call(q, k, v, pattern, is_causal: bool, bwd: bool, name: str) -> float:  # type: ignore[no-untyped-def]
    import torch

    from attnlab import scaled_dot_product_attention

    t0 = time.perf_counter()
    with torch.set_grad_enabled(bwd):
        out = scaled_dot_product_attention(q, k, v, pattern, is_causal=is_causal, backend=name)
        if bwd:
            out.sum().backward()  # type: ignore[union-attr]
    return time.perf_counter() - t0


def calibrate(rounds: int = 2) -> None:
    """Fit ``overhead + seconds_per_unit * units`` per backend and pass; print the table.

    Measured in this process, every backend of a cell back to back and the best of
    ``rounds`` kept, so that all backends of a cell see the same machine load.
    """
    import torch

    from attnlab.backends import AttentionCall
    from attnlab.backends.cost_model import computed_pairs, units
    from attnlab.backends.flex import BLOCK_SIZE
    from attnlab.backends.sparse import BLOCK, _banded_pairs
    from attnlab.backends.tiled import BLOCK_K, BLOCK_Q
    from attnlab.functional import masks

    if os.environ.get("ATTNLAB_BENCH_THREADS"):
        torch.set_num_threads(int(os.environ["ATTNLAB_BENCH_THREADS"]))
    dev = os.environ.get("ATTNLAB_BENCH_DEVICE", "cpu")
    blocks = {
        "tiled": (BLOCK_Q, BLOCK_K),
        "sparse": (BLOCK, BLOCK),
        "flex": (BLOCK_SIZE, BLOCK_SIZE),
    }
    points: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    plan = [(False, 2048), (False, 8192), (True, 1024), (True, 2048)]
    for bwd, L in plan:
        for mask in ("causal", "window"):
            pattern = masks.sliding_window(WINDOW - 1) if mask == "window" else None
            torch.manual_seed(0)
            q, k, v = (
                torch.randn(1, HEADS, L, HEAD_DIM, device=dev, requires_grad=bwd) for _ in range(3)
            )
            names = ["sdpa", "tiled", "sparse"] + ([] if bwd else ["flex"])
            if L <= 2048:
                names.append("reference")

            run = functools.partial(_timed_call, q, k, v, pattern, mask == "causal", bwd)
            for name in names:
                run(name)  # warm-up (compiles flex)
            best = dict.fromkeys(names, math.inf)
            for _ in range(rounds):
                for name in names:
                    best[name] = min(best[name], run(name))
            call = AttentionCall.from_inputs(
                q,
                k,
                v,
                pattern,
                dropout_p=0.0,
                is_causal=mask == "causal",
                enable_gqa=False,
                return_weights=False,
            )
            for name in names:
                row = name
                band = _banded_pairs(call) if name == "sparse" else None
                if band is not None:  # the sparse backend's banded path: its own constants
                    row, pairs = "sparse_band", band
                elif name in blocks:
                    pairs = computed_pairs(call, *blocks[name])
                elif name == "sdpa" and mask == "causal":
                    pairs = L * L / 2  # the flash path: "sdpa_flash" in the table
                else:
                    pairs = L * L
                points.setdefault((row, bwd), []).append((units(call, pairs), best[name]))
            line = ", ".join(f"{n} {best[n] * 1e3:.1f}" for n in names)
            print(
                f"# {mask} L={L} {'fwd+bwd' if bwd else 'fwd'} (ms): {line}",
                file=sys.stderr,
                flush=True,
            )
    table: dict[str, dict[str, tuple[float, float]]] = {}
    for (name, bwd), pts in points.items():
        n = len(pts)
        mx = sum(p[0] for p in pts) / n
        my = sum(p[1] for p in pts) / n
        sxx = sum((p[0] - mx) ** 2 for p in pts) or 1.0
        slope = max(sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx, 1e-12)
        icpt = max(my - slope * mx, 0.0)
        if icpt == 0.0:  # refit through the origin
            slope = sum(p[0] * p[1] for p in pts) / sum(p[0] ** 2 for p in pts)
        table.setdefault(name, {})["fwd_bwd" if bwd else "fwd"] = (icpt, slope)
    table["flex"]["fwd_bwd"] = (1e-3, 3 * table["flex"]["fwd"][1])  # no CPU backward: a guess
    print(f'    "{torch.device(dev).type}": {{')
    for b in ("reference", "sdpa", "tiled", "sparse", "sparse_band", "flex"):
        row = table[b]
        items = ", ".join(
            f'"{k}": ({a:.2g}, {s:.3g})' for k, (a, s) in sorted(row.items(), reverse=True)
        )
        print(f'        "{b}": {{{items}}},')
    print("    },")


def targets(rounds: int) -> dict:
    """The issue's target cells, measured in one process, alternating backends, best of ``rounds``.

    On a shared machine the fresh-process cells of :func:`full_run` are measured minutes
    apart under different loads; here each round runs every contender back to back,
    so the ratios compare like with like.
    """
    import torch
    import torch.nn.functional as F

    from attnlab import scaled_dot_product_attention
    from attnlab.functional import masks

    def best(fns: dict, n: int) -> dict[str, float]:
        out = dict.fromkeys(fns, math.inf)
        for _ in range(n):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                out[name] = min(out[name], time.perf_counter() - t0)
        return out

    if os.environ.get("ATTNLAB_BENCH_THREADS"):
        torch.set_num_threads(int(os.environ["ATTNLAB_BENCH_THREADS"]))
    res: dict = {"threads": torch.get_num_threads()}
    torch.manual_seed(0)
    with torch.no_grad():
        q, k, v = (torch.randn(1, HEADS, 4096, HEAD_DIM) for _ in range(3))
        fns = {
            "torch": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            **{
                b: (lambda b=b: scaled_dot_product_attention(q, k, v, is_causal=True, backend=b))
                for b in ("tiled", "flex", "auto")
            },
        }
        for fn in fns.values():
            fn()  # warm-up, compiles flex
        res["causal_4096"] = best(fns, rounds)
        print("causal 4096:", res["causal_4096"], flush=True)
        window = masks.sliding_window(WINDOW - 1)
        for L in (16384, 32768):
            q, k, v = (torch.randn(1, HEADS, L, HEAD_DIM) for _ in range(3))
            fns = {
                b: functools.partial(scaled_dot_product_attention, q, k, v, window, backend=b)
                for b in ("tiled", "sparse", "flex", "auto")
            }
            if L == 16384:
                dense = window.to_dense(L, L)
                fns["torch"] = functools.partial(F.scaled_dot_product_attention, q, k, v, dense)
            for fn in fns.values():
                fn()
            res[f"window_{L}"] = best(fns, rounds if L == 16384 else max(1, rounds - 1))
            print(f"window {L}:", res[f"window_{L}"], flush=True)
            del fns
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="lengths 512..2048 only")
    ap.add_argument("--calibrate", action="store_true", help="print cost-model constants")
    ap.add_argument("--lengths", type=int, nargs="*", help="override the lengths")
    ap.add_argument(
        "--targets",
        type=int,
        metavar="ROUNDS",
        help="the issue's target cells, alternating, in-process",
    )
    ap.add_argument("--backends", nargs="*", default=BACKENDS)
    ap.add_argument("--device", default=None, help="cpu (default) or cuda; cells inherit it")
    ap.add_argument(
        "--threads", type=int, default=None, help="torch threads in every cell (default: torch's)"
    )
    ap.add_argument("--out", type=Path, default=None, help="results file (default build/bench/)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per cell")
    ap.add_argument("--no-docs", action="store_true", help="do not write docs/")
    ap.add_argument("--from-json", type=Path, help="only rebuild the report from a saved run")
    ap.add_argument(
        "--cell", nargs=4, metavar=("BACKEND", "MASK", "L", "BWD"), help=argparse.SUPPRESS
    )
    args = ap.parse_args()
    if args.device:
        os.environ["ATTNLAB_BENCH_DEVICE"] = args.device
    if args.threads:
        os.environ["ATTNLAB_BENCH_THREADS"] = str(args.threads)
    if args.cell:
        b, m, L, bwd = args.cell
        print(json.dumps(run_cell(b, m, int(L), bwd == "1", reps=3)))
        return
    if args.calibrate:
        calibrate()
        return
    if args.targets:
        out = ROOT / "build" / "bench"
        out.mkdir(parents=True, exist_ok=True)
        res = targets(args.targets)
        (args.out or out / "targets.json").write_text(json.dumps(res, indent=1))
        return
    out = ROOT / "build" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        results = json.loads(args.from_json.read_text())
    else:
        lengths = args.lengths or ([512, 1024, 2048] if args.quick else LENGTHS)
        results = full_run(lengths, args.backends, args.out or out / "attention.json", args.timeout)
        results["threads"] = args.threads
    text = report(results)
    print(text)
    if not args.no_docs and not args.quick:
        plot(results, ROOT / "docs" / "attention_backends.png")
        write_section(text, ROOT / "docs" / "benchmarks.md")


if __name__ == "__main__":
    main()
