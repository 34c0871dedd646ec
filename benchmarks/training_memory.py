"""Gradient checkpointing, tiled attention and bfloat16: activation memory, peak memory and
step time of one training step, beside what ``attnlab estimate --mode training`` predicts.

    python benchmarks/training_memory.py                       # the issue's sizes
    python benchmarks/training_memory.py --layers 4 --seq-len 512 --configs fp32-sdpa --rounds 1

For each configuration a fresh process builds the decoder (Llama components, 12 layers,
hidden 768, 12 heads, vocabulary 32000 by default), runs two AdamW steps on ``batch 1 x
seq-len`` tokens and reports:

* the activations kept for the backward, counted exactly: every tensor autograd saves
  (``torch.autograd.graph.saved_tensors_hooks``; one count per storage, parameters
  excluded), split into the layers and the LM head + loss (the logits and their
  log-probabilities, not checkpointed), plus the layer inputs a checkpoint keeps;
* the peak resident memory of the process over two steps (``ru_maxrss``; the second
  step runs with AdamW's state allocated, as every later step does) above its resident
  memory before the model was built: weights, gradients, AdamW's state, activations and
  transients;
* ``attnlab estimate``'s prediction of the same total.

Step times are measured in one process, alternating checkpointing off and on, with one
thread and process time (this machine is shared: wall time would measure the others).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line, time_interleaved, write_section

CONFIGS = {
    "fp32-sdpa": ("float32, sdpa", "sdpa", "float32"),
    "fp32-tiled": ("float32, tiled", "tiled", "float32"),
    "bf16-sdpa": ("bfloat16 autocast, sdpa", "sdpa", "bfloat16"),
}


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _current_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _config(args: argparse.Namespace, ckpt: bool) -> Any:
    from attnlab.models import DecoderConfig

    return DecoderConfig.llama(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=args.seq_len,
        gradient_checkpointing=ckpt,
    )


class SavedCounter:
    """Bytes autograd saves for the backward, by phase, one count per storage."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: set[int] = set()
        self.phase = "embeddings"
        self.bytes: dict[str, int] = {}

    def add(self, t: torch.Tensor, phase: str | None = None) -> None:
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr in self.params or ptr in self.seen or ptr == 0:
            return
        self.seen.add(ptr)
        key = phase or self.phase
        self.bytes[key] = self.bytes.get(key, 0) + s.nbytes()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.add(t)
        return t


def child(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    from attnlab.backends import use
    from attnlab.models import DecoderLM

    autocast: Any = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if args.dtype == "bfloat16"
        else torch.autocast("cpu", enabled=False)
    )
    # warm up the kernels, the autograd engine and the optimizer on a tiny model first, so
    # that the baseline holds the libraries' one-off allocations
    tiny_args = argparse.Namespace(**{**vars(args), "layers": 1, "hidden": 32, "heads": 2})
    tiny = DecoderLM(_config(tiny_args, args.ckpt)).train()
    tiny_ids = torch.randint(0, args.vocab, (1, 16))
    with use(args.backend):
        with autocast:
            tiny_loss = tiny(input_ids=tiny_ids, labels=tiny_ids).loss
        tiny_loss.backward()
    torch.optim.AdamW(tiny.parameters(), foreach=False).step()
    del tiny, tiny_loss
    base = _current_rss()
    torch.manual_seed(0)
    model = DecoderLM(_config(args, args.ckpt)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    ids = torch.randint(0, args.vocab, (1, args.seq_len))
    counter = SavedCounter(model)
    model.layers[0].register_forward_pre_hook(lambda *_: setattr(counter, "phase", "layers"))
    model.norm.register_forward_pre_hook(lambda *_: setattr(counter, "phase", "head"))
    if args.ckpt:  # a checkpoint keeps each layer's input itself (not through the hooks)
        for layer in model.layers:
            layer.register_forward_pre_hook(
                lambda _m, a: counter.add(a[0], "layers") if torch.is_grad_enabled() else None
            )
    with use(args.backend):  # a first step allocates AdamW's state, as in steady training
        with autocast:
            first = model(input_ids=ids, labels=ids).loss
        first.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    del first
    t0 = time.process_time()
    with use(args.backend):
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t), autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    step = time.process_time() - t0
    print(
        json.dumps(
            {
                "peak_bytes": _rss() - base,
                "saved": counter.bytes,
                "step_cpu_s": step,
                "loss": float(loss),
            }
        )
    )


def _estimate(args: argparse.Namespace, backend: str, dtype: str, ckpt: bool) -> Any:
    from attnlab.analysis.cost import estimate

    return estimate(
        _config(args, ckpt),
        batch_size=1,
        seq_len=args.seq_len,
        mode="training",
        dtype="bf16" if dtype == "bfloat16" else "float32",
        backend=backend,
        checkpointing=ckpt,
    )


def _run_child(args: argparse.Namespace, backend: str, dtype: str, ckpt: bool) -> dict[str, Any]:
    cmd = [
        sys.executable, __file__, "--child", "--backend", backend, "--dtype", dtype,
        "--layers", str(args.layers), "--hidden", str(args.hidden), "--heads", str(args.heads),
        "--vocab", str(args.vocab), "--seq-len", str(args.seq_len), "--threads", str(args.threads),
    ] + (["--ckpt"] if ckpt else [])  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _step_times(args: argparse.Namespace) -> dict[str, float]:
    """Median process time of a step with checkpointing off and on, alternating."""
    from attnlab.models import DecoderLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = DecoderLM(_config(args, False)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    ids = torch.randint(0, args.vocab, (1, args.seq_len))

    def step(ckpt: bool) -> None:
        model.config.gradient_checkpointing = ckpt
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = time_interleaved(
        {"off": lambda: step(False), "on": lambda: step(True)},
        rounds=args.rounds,
        warmup=1,
        clock=time.process_time,
    )
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def _mib(b: float) -> str:
    return f"{b / 2**20:,.0f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--backend", default="sdpa")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--ckpt", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated, from {list(CONFIGS)} (bfloat16 matmuls are ~30x slower than "
        "float32 on AVX2-only CPUs)",
    )
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args()
    if args.child:
        child(args)
        return
    rows = []
    head = (
        "| configuration | checkpointing | kept by the layers, MiB | LM head + loss, MiB | "
        "peak above start, MiB | estimate, MiB | measured / estimate |\n|---|---|---|---|---|---|---|"
    )
    layer_kept: dict[tuple[str, bool], int] = {}
    peaks: dict[tuple[str, bool], int] = {}
    chosen = [CONFIGS[c] for c in args.configs.split(",")]
    for label, backend, dtype in chosen:
        for ckpt in (False, True):
            r = _run_child(args, backend, dtype, ckpt)
            est = _estimate(args, backend, dtype, ckpt)
            layers = r["saved"].get("layers", 0)
            head_b = r["saved"].get("head", 0)
            layer_kept[(label, ckpt)] = layers
            peaks[(label, ckpt)] = r["peak_bytes"]
            rows.append(
                f"| {label} | {'on' if ckpt else 'off'} | {_mib(layers)} | {_mib(head_b)} | "
                f"{_mib(r['peak_bytes'])} | {_mib(est.total_bytes)} | "
                f"{r['peak_bytes'] / est.total_bytes:.2f} |"
            )
            print(rows[-1], flush=True)
    times = _step_times(args) if args.rounds else {}
    lines = [head, *rows, ""]
    for label, _, _ in chosen:
        cut = layer_kept[(label, False)] / max(1, layer_kept[(label, True)])
        peak_cut = peaks[(label, False)] / max(1, peaks[(label, True)])
        lines.append(
            f"- {label}: checkpointing keeps {cut:.1f}x fewer activation bytes in the layers; "
            f"peak above start {peak_cut:.2f}x lower."
        )
    if times:
        ratio = times["on"] / times["off"]
        lines.append(
            f"- step time (float32, sdpa, process time, {args.threads} thread(s), median of "
            f"{args.rounds} alternating): off {times['off']:.1f} s, on {times['on']:.1f} s, "
            f"**{ratio:.2f}x** (recomputing the forward ideally costs about 1.33x)."
        )
    body = (
        f"Decoder (Llama components), {args.layers} layers, hidden {args.hidden}, {args.heads} "
        f"heads, vocabulary {args.vocab}, batch 1, {args.seq_len} tokens, one AdamW step. "
        f"{machine_line()}; a shared 2-core machine, loaded by other processes while "
        f"measured.\n\n`python benchmarks/training_memory.py --layers {args.layers} --hidden "
        f"{args.hidden} --seq-len {args.seq_len} --configs {args.configs} --rounds "
        f"{args.rounds}`\n\n" + "\n".join(lines)
    )
    print(body)
    if not args.no_write:
        write_section(
            f"## Training memory: {args.layers} layers, hidden {args.hidden}, "
            f"{args.seq_len} tokens ({args.configs})",
            body,
        )


if __name__ == "__main__":
    main()
