"""Prefill of a Mistral-shaped model: attnlab vs transformers' Mistral (sdpa), same weights.

The shape of issue 8: hidden 768, intermediate 2048, 12 heads, 4 key/value heads, vocab
1000, 2 layers, sliding window 512, logits of the last token only. attnlab passes the
window as a pattern (``sliding_window(511)``) and its backend skips the tiles outside it;
transformers' sdpa path builds a dense ``L x L`` mask and computes every score. Measured
in one run, alternating; the attention share of each is its attention call timed bare on
the same shapes (times the layer count) over the whole forward.

Usage::

    python benchmarks/prefill.py --seq-len 8192 --repeats 3 [--update-docs]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import attnlab
from attnlab import scaled_dot_product_attention
from attnlab.backends import explain
from attnlab.functional import masks as M

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADING = "## Prefill, Mistral-shaped (issue 8)"
SHAPE = dict(hidden=768, inter=2048, heads=12, kv_heads=4, vocab=1000, layers=2, window=512)


def build(seq_len: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(
        vocab_size=SHAPE["vocab"],
        hidden_size=SHAPE["hidden"],
        intermediate_size=SHAPE["inter"],
        num_attention_heads=SHAPE["heads"],
        num_key_value_heads=SHAPE["kv_heads"],
        num_hidden_layers=SHAPE["layers"],
        sliding_window=SHAPE["window"],
        max_position_embeddings=seq_len,
        attn_implementation="sdpa",
    )
    hf = MistralForCausalLM(cfg).eval()
    return hf, attnlab.from_hf(hf)


CLOCK = time.perf_counter


def timed(fn: object, *args: object, **kw: object) -> float:
    t0 = CLOCK()
    fn(*args, **kw)  # type: ignore[operator]
    return CLOCK() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall clock, or this process's CPU time (steadier on a shared machine; use with "
        "--threads 1)",
    )
    p.add_argument("--update-docs", action="store_true")
    args = p.parse_args()
    global CLOCK
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        CLOCK = time.process_time
    n = args.seq_len
    hf, ours = build(n)
    ids = torch.randint(0, SHAPE["vocab"], (1, n), generator=torch.Generator().manual_seed(0))
    hd = SHAPE["hidden"] // SHAPE["heads"]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, SHAPE["heads"], n, hd, generator=g)
    k, v = (torch.randn(1, SHAPE["kv_heads"], n, hd, generator=g) for _ in range(2))
    window = M.sliding_window(SHAPE["window"] - 1)
    dense = window.to_dense(n, n)  # what transformers' sdpa path hands torch: [L, L] bool
    slots = torch.arange(n)[None]  # the model's call carries its slots
    chosen = explain(q, k, v, window, enable_gqa=True, q_positions=slots, k_positions=slots).chosen
    t = {k: [] for k in ("ours", "hf", "ours_attn", "hf_attn")}  # type: dict[str, list[float]]
    with torch.inference_mode():
        a = ours(ids, logits_to_keep=1).logits
        b = hf(ids, logits_to_keep=1).logits
        diff = float((a - b).abs().max())
        for _ in range(args.repeats):
            t["ours"].append(timed(ours, ids, logits_to_keep=1))
            t["hf"].append(timed(hf, ids, logits_to_keep=1))
            t["ours_attn"].append(
                timed(
                    scaled_dot_product_attention,
                    q,
                    k,
                    v,
                    window,
                    enable_gqa=True,
                    q_positions=slots,
                    k_positions=slots,
                )
            )
            t["hf_attn"].append(
                timed(F.scaled_dot_product_attention, q, k, v, attn_mask=dense, enable_gqa=True)
            )
    m = {k: statistics.median(v) for k, v in t.items()}
    layers = SHAPE["layers"]
    lines = [
        f"Mistral-shaped prefill ({SHAPE}), {n} tokens, batch 1, float32, last token's "
        f"logits, median of {args.repeats} alternating runs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s), {args.clock} clock; `auto` runs the window on "
        f"`{chosen}`; max |logit difference| {diff:.2e}:",
        "",
        "| | forward, s | attention share | speed-up |",
        "|---|---|---|---|",
        f"| attnlab | {m['ours']:.2f} | {layers * m['ours_attn'] / m['ours']:.0%} | "
        f"{m['hf'] / m['ours']:.2f}x |",
        f"| transformers (sdpa) | {m['hf']:.2f} | {layers * m['hf_attn'] / m['hf']:.0%} | 1.00x |",
    ]
    text = "\n".join(lines)
    print(text)
    if args.update_docs:
        doc = DOCS.read_text()
        if HEADING not in doc:
            doc = doc.rstrip() + f"\n\n{HEADING}\n"
        start = doc.index(HEADING) + len(HEADING)
        nxt = doc.find("\n## ", start)
        end = len(doc) if nxt < 0 else nxt
        cmd = "python benchmarks/prefill.py " + " ".join(sys.argv[1:])
        DOCS.write_text(doc[:start] + f"\n\nCommand: `{cmd}`\n\n{text}\n" + doc[end:])


if __name__ == "__main__":
    main()
