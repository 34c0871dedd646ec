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
        [--scaling 1024,2048,4096] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _child(folder: str, impl: str, seq: int, reps: int, backend: str) -> None:
    import torch
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

            ctx = backends.use(backend)
        else:
            import contextlib

            ctx = contextlib.nullcontext()
        with ctx:
            for i in range(reps + 1):
                t0 = time.perf_counter()
                out = model(input_ids=ids, attention_mask=mask, global_attention_mask=glob)
                if i:
                    times.append(time.perf_counter() - t0)
            h = out.last_hidden_state
    torch.save(h[0, :64].clone(), os.path.join(folder, f"out-{impl}-{seq}.pt"))
    print(
        json.dumps(
            {
                "seconds": statistics.median(times),
                "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "load_mib": rss_load,
            }
        )
    )


def _measure(folder: str, impl: str, seq: int, reps: int, backend: str) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", folder, impl, str(seq), str(reps), backend]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{impl} at {seq} failed:\n{done.stderr[-2000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        folder, impl, seq, reps, backend = sys.argv[2:7]
        _child(folder, impl, int(seq), int(reps), backend)
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
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()

    import torch
    import transformers

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _common import machine_line, write_section

    cfg = transformers.LongformerConfig(
        vocab_size=1000,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=max(args.seq, *[int(x) for x in args.scaling.split(",") if x]) + 2,
        attention_window=args.window,
    )
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        transformers.LongformerModel(cfg).save_pretrained(folder)
        runs: dict[str, list[dict[str, float]]] = {"transformers": [], "attnlab": []}
        for _ in range(args.rounds):
            for impl in runs:
                runs[impl].append(_measure(folder, impl, args.seq, args.reps, args.backend))
        a = torch.load(os.path.join(folder, f"out-attnlab-{args.seq}.pt"))
        b = torch.load(os.path.join(folder, f"out-transformers-{args.seq}.pt"))
        diff = (a - b).abs().max().item()
        scaling = []
        for n in [int(x) for x in args.scaling.split(",") if x]:
            scaling.append((n, _measure(folder, "attnlab", n, 1, args.backend)))
    med = {
        k: {f: statistics.median(r[f] for r in v) for f in ("seconds", "peak_mib", "load_mib")}
        for k, v in runs.items()
    }
    t, o = med["transformers"], med["attnlab"]
    rows = [
        "| implementation | median s per forward | peak RSS MiB | RSS after load MiB | forward added MiB |",
        "|---|---|---|---|---|",
    ]
    for name, m in (("transformers LongformerModel", t), (f"attnlab ({args.backend})", o)):
        rows.append(
            f"| {name} | {m['seconds']:.2f} | {m['peak_mib']:.0f} | {m['load_mib']:.0f} | "
            f"{m['peak_mib'] - m['load_mib']:.0f} |"
        )
    text = (
        f"{args.seq} tokens, batch 1, {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
        f"attention_window {args.window}, 3 global tokens, float32, inference; each cell a fresh "
        f"subprocess (median of {args.rounds} per implementation, {args.reps} timed forwards each); "
        f"{machine_line()}.\n\n" + "\n".join(rows) + "\n\n"
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
