"""Longformer at long sequence lengths: attnlab vs transformers' ``LongformerModel``, time and peak memory.

Same random weights (transformers' init, seed 0, saved once to a temporary folder), one
sequence, float32, inference mode, global attention on the first token plus a few more.
Every measurement runs in a fresh subprocess, which loads the model, runs one warm-up
forward and then ``--reps`` timed forwards, and reports the median time and its peak
resident memory (``ru_maxrss``, which glibc's retained buffers cannot hide); the
subprocesses alternate between the two implementations. ``rss after load`` is the
resident memory before the first forward, so ``peak - after load`` is what the forward
itself added.

    python benchmarks/longformer.py [--seq 4096] [--layers 2] [--window 512] [--rounds 2]
        [--scaling 1024,2048,4096] [--threads 1 --clock cpu] [--write]

The floor is the forward's own matmuls called bare (the six ``D x D`` projections, the
feed-forward and the attention products over exactly the attended pairs), timed in a
subprocess of its own the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _floor(model_cfg: dict[str, int], seq: int, reps: int, clock: Callable[[], float]) -> float:
    """One forward's own matmuls, called bare: the linears and the attended pairs' products.

    Per layer: six ``D x D`` projections on every token (query, key, value, the global
    key and value, the output), the two feed-forward matmuls, and the attention products
    over exactly the pairs Longformer attends (``2w + 1 + G`` keys per query, per head)
    as two batched products. No softmax, masks, norms or gathers.
    """
    import torch
    import torch.nn.functional as F

    d, heads, layers = model_cfg["hidden"], model_cfg["heads"], model_cfg["layers"]
    keys = model_cfg["window"] + 1 + 3  # 2w + 1 keys of the window, 3 global keys
    g = torch.Generator().manual_seed(0)
    x = torch.randn(seq, d, generator=g)
    w_dd = torch.randn(d, d, generator=g) / d**0.5
    w_up = torch.randn(4 * d, d, generator=g) / d**0.5
    w_down = torch.randn(d, 4 * d, generator=g) / d**0.5
    e = d // heads
    rows = heads * seq // 64
    q = torch.randn(rows, 64, e, generator=g)
    k = torch.randn(rows, e, keys, generator=g)
    p = torch.randn(rows, 64, keys, generator=g)
    v = torch.randn(rows, keys, e, generator=g)
    times = []
    with torch.inference_mode():
        for i in range(reps + 1):
            t0 = clock()
            for _ in range(layers):
                for _ in range(6):
                    F.linear(x, w_dd)
                F.linear(F.linear(x, w_up), w_down)
                torch.bmm(q, k)
                torch.bmm(p, v)
            if i:
                times.append(clock() - t0)
    return statistics.median(times)


def _child(
    folder: str, impl: str, seq: int, reps: int, backend: str, threads: int, clock_name: str
) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)
    clock = time.process_time if clock_name == "cpu" else time.perf_counter
    chosen = ""
    if impl == "floor":
        cfg = json.loads(Path(folder, "config.json").read_text())
        dims = {
            "hidden": cfg["hidden_size"],
            "heads": cfg["num_attention_heads"],
            "layers": cfg["num_hidden_layers"],
            "window": cfg["attention_window"][0],
        }
        print(json.dumps({"seconds": _floor(dims, seq, reps, clock), "peak_mib": 0, "load_mib": 0}))
        return
    import transformers

    if impl == "transformers":
        model = transformers.LongformerModel.from_pretrained(folder).eval()
    else:
        import attnlab

        model = attnlab.from_hf(folder)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, model.config.vocab_size, (1, seq), generator=g)
    glob = torch.zeros_like(ids)
    glob[0, [0, seq // 3, seq // 2]] = 1
    mask = torch.ones_like(ids)
    rss_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    times = []
    with torch.inference_mode():
        if impl == "attnlab" and backend != "auto":
            import attnlab.backends as backends

            ctx: contextlib.AbstractContextManager[None] = backends.use(backend)
        else:
            ctx = contextlib.nullcontext()
        with ctx:
            for i in range(reps + 1):
                t0 = clock()
                out = model(input_ids=ids, attention_mask=mask, global_attention_mask=glob)
                if i:
                    times.append(clock() - t0)
            h = out.last_hidden_state
        if impl == "attnlab":
            from attnlab.backends import explain
            from attnlab.modules.longformer_attention import longformer_pattern

            heads = model.config.num_attention_heads
            q = torch.empty(1, heads, seq, model.config.hidden_size // heads)
            window = model.layers[0].attention.window
            pattern = longformer_pattern(window, glob.bool(), None)
            chosen = explain(q, q, q, attn_mask=pattern, backend=backend).chosen
    torch.save(h[0, :64].clone(), os.path.join(folder, f"out-{impl}-{seq}.pt"))
    print(
        json.dumps(
            {
                "seconds": statistics.median(times),
                "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "load_mib": rss_load,
                "backend": chosen,
            }
        )
    )


def _measure(
    folder: str, impl: str, seq: int, reps: int, backend: str, threads: int, clock: str
) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", folder, impl, str(seq), str(reps), backend]
    cmd += [str(threads), clock]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{impl} at {seq} failed:\n{done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        folder, impl, seq, reps, backend, threads, clock = sys.argv[2:9]
        _child(folder, impl, int(seq), int(reps), backend, int(threads), clock)
        return
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--reps", type=int, default=2, help="timed forwards per subprocess")
    ap.add_argument("--rounds", type=int, default=2, help="subprocesses per implementation")
    ap.add_argument("--backend", default="auto", help="attnlab's backend (default auto)")
    ap.add_argument("--scaling", default="", help="comma list of lengths for attnlab's memory")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall-clock time, or the subprocess's CPU time (with --threads 1: robust to load)",
    )
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()

    import torch
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _common import machine_line, write_section

    cfg = transformers.LongformerConfig(
        vocab_size=1000,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=max([args.seq, *[int(x) for x in args.scaling.split(",") if x]])
        + 2,
        attention_window=args.window,
    )
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        transformers.LongformerModel(cfg).save_pretrained(folder)
        runs: dict[str, list[dict[str, Any]]] = {"transformers": [], "attnlab": [], "floor": []}
        how = (args.backend, args.threads, args.clock)
        for _ in range(args.rounds):
            for impl in runs:
                runs[impl].append(_measure(folder, impl, args.seq, args.reps, *how))
        a = torch.load(os.path.join(folder, f"out-attnlab-{args.seq}.pt"))
        b = torch.load(os.path.join(folder, f"out-transformers-{args.seq}.pt"))
        diff = (a - b).abs().max().item()
        scaling = []
        for n in [int(x) for x in args.scaling.split(",") if x]:
            scaling.append((n, _measure(folder, "attnlab", n, 1, *how)))
    med = {
        k: {f: statistics.median(r[f] for r in v) for f in ("seconds", "peak_mib", "load_mib")}
        for k, v in runs.items()
    }
    t, o, fl = med["transformers"], med["attnlab"], med["floor"]["seconds"]
    chosen = runs["attnlab"][0].get("backend", "")
    rows = [
        "| implementation | median s per forward | / floor | peak RSS MiB | RSS after load MiB "
        "| forward added MiB |",
        "|---|---|---|---|---|---|",
    ]
    label = f"attnlab ({args.backend}: {chosen})" if args.backend == "auto" else "attnlab"
    for name, m in (("transformers LongformerModel", t), (label, o)):
        rows.append(
            f"| {name} | {m['seconds']:.2f} | {m['seconds'] / fl:.2f} | {m['peak_mib']:.0f} | "
            f"{m['load_mib']:.0f} | {m['peak_mib'] - m['load_mib']:.0f} |"
        )
    rows.append(f"| floor: the forward's matmuls, bare | {fl:.2f} | 1.00 | | | |")
    clock_words = "process CPU time" if args.clock == "cpu" else "wall clock"
    text = (
        f"{args.seq} tokens, batch 1, {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
        f"attention_window {args.window}, 3 global tokens, float32, inference; each cell a fresh "
        f"subprocess (median of {args.rounds} per implementation, {args.reps} timed forwards each, "
        f"{clock_words}); {machine_line()}.\n\n" + "\n".join(rows) + "\n\n"
        f"attnlab is {t['seconds'] / o['seconds']:.2f}x faster; its forward adds "
        f"{(o['peak_mib'] - o['load_mib']) / max(1.0, t['peak_mib'] - t['load_mib']):.2f}x the "
        f"memory transformers' adds. Max |difference| of the first 64 tokens' states: {diff:.1e}."
    )
    if scaling:
        text += "\n\nattnlab's forward memory by length (one subprocess each):\n\n"
        text += "| tokens | forward added MiB | per token KiB |\n|---|---|---|\n"
        for n, m in scaling:
            added = m["peak_mib"] - m["load_mib"]
            text += f"| {n} | {added:.0f} | {1024 * added / n:.0f} |\n"
    print(text)
    if args.write:
        cmd = " ".join(["python benchmarks/longformer.py", *sys.argv[1:]])
        write_section(
            "## Longformer (issue 8)",
            f"Command: `{cmd}`. Taken on the shared 2-core machine while other jobs ran.\n\n{text}",
        )


if __name__ == "__main__":
    main()
