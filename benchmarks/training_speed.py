"""Training throughput: attnlab's decoder against transformers' Llama with the same weights,
in the same plain loop (forward with labels, backward, AdamW step), eager; and the gain of
compiling attnlab's step with ``torch.compile``.

    python benchmarks/training_speed.py
    python benchmarks/training_speed.py --layers 2 --hidden 128 --seq-len 128 --no-compile

One thread and process time, alternating the candidates round by round: the machine is
shared, and process time barely sees the other processes. The floor is the step's own
matmuls timed bare (6 x parameters x tokens of forward + backward, at the machine's measured
matmul rate).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line, time_interleaved, write_section


def _matmul_rate(n: int = 512) -> float:
    """FLOP/s of a bare ``n x n`` float32 matmul (process time)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    t0 = time.process_time()
    reps = 20
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.process_time() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    import attnlab
    from attnlab.models import DecoderConfig, DecoderLM
    from attnlab.train.build import init_weights

    torch.manual_seed(0)
    config = DecoderConfig.llama(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=int(2.75 * args.hidden),
        max_position_embeddings=args.seq_len,
    )
    ours = DecoderLM(config).train()
    init_weights(ours, 0.02)
    theirs = attnlab.to_hf(ours).train()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len))

    def make_step(model: Any, forward: Any) -> Any:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)

        def step() -> None:
            forward(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    with torch.no_grad():
        a = ours(input_ids=ids, labels=ids).loss
        b = theirs(input_ids=ids, labels=ids).loss
    steps = {
        "attnlab (eager)": make_step(ours, ours),
        "transformers (eager)": make_step(theirs, theirs),
    }
    if not args.no_compile:
        ours_c = DecoderLM(config).train()
        ours_c.load_state_dict(ours.state_dict())
        compiled = torch.compile(ours_c)
        t0 = time.perf_counter()
        make_step(ours_c, compiled)()  # compile outside the timing
        compile_s = time.perf_counter() - t0
        steps["attnlab (compiled)"] = make_step(ours_c, compiled)
    times = time_interleaved(steps, rounds=args.rounds, warmup=1, clock=time.process_time)
    tokens = args.batch * args.seq_len
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    params = sum(p.numel() for p in ours.parameters())
    floor = 6 * params * tokens / _matmul_rate()
    rows = [
        "| loop | step, s (process time) | tokens/s | vs transformers | step / matmul floor |",
        "|---|---|---|---|---|",
    ]
    for k, t in med.items():
        rows.append(
            f"| {k} | {t:.3f} | {tokens / t:,.0f} | {med['transformers (eager)'] / t:.2f}x | "
            f"{t / floor:.2f} |"
        )
    notes = [
        f"- losses on the same batch before training: attnlab {float(a):.6f}, transformers "
        f"{float(b):.6f}.",
        f"- floor: 6 x {params:,} parameters x {tokens} tokens at the bare matmul rate "
        f"= {floor:.3f} s.",
    ]
    if not args.no_compile:
        gain = med["attnlab (eager)"] / med["attnlab (compiled)"]
        notes.append(
            f"- torch.compile of attnlab's model: {gain:.2f}x the eager step "
            f"(first compiled step, compile included: {compile_s:.0f} s wall)."
        )
    body = (
        f"Llama components, {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
        f"vocabulary {args.vocab}, batch {args.batch} x {args.seq_len} tokens, float32, "
        f"AdamW; median of {args.rounds} alternating rounds. {machine_line()}; a shared "
        "2-core machine, loaded by other processes while measured (process time).\n\n"
        "`python benchmarks/training_speed.py`\n\n" + "\n".join([*rows, "", *notes])
    )
    print(body)
    if not args.no_write:
        write_section("## Training throughput: attnlab against transformers", body)


if __name__ == "__main__":
    main()
