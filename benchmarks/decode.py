"""Decoding speed: attnlab ``generate`` vs transformers ``generate`` on the same Llama weights.

Measures, in one run and alternating between the libraries:

1. tokens/s of greedy generation (256 new tokens) at batch 1 and 8, and the ratio
   attnlab / transformers;
2. per-token decode time at contexts 256, 1024 and 4096 with attnlab's KV cache
   (one new token against a cache of ``C`` tokens) and without it (recomputing the
   whole prefix for each token), and the ratio of the largest to the smallest context.

The model is a random Llama (4 layers, hidden 256, 8 heads, 2 key/value heads) built in
transformers and converted with ``attnlab.from_hf``, so both libraries run the same
weights. Figures on a shared CPU are noisy; compare the ratios.

3. with ``--floor``, the decode table of issue 8: per-token time of attnlab eager and
   compiled (``generate(compile=True)``), transformers' ``generate`` and transformers
   with a static cache and a compiled step, each as a ratio to the *floor*: the step's
   own matmuls (q, k, v, o, the MLP's and the LM head's ``F.linear`` on the same
   weights) called bare in the same run.

Usage::

    python benchmarks/decode.py                   # prints the tables
    python benchmarks/decode.py --update-docs     # also writes docs/benchmarks.md
    python benchmarks/decode.py --floor --vocabs 1000 4096 32000 --batches 1 8
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import attnlab

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADING = "## Decoding (issue 3)"
FLOOR_HEADING = "## Decoding against the floor (issue 8)"


def build(max_positions: int, vocab: int = 32000) -> tuple[torch.nn.Module, torch.nn.Module]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )
    hf = LlamaForCausalLM(cfg).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf, attnlab.from_hf(hf)


CLOCK: Callable[[], float] = time.perf_counter


def timed(fn: Callable[..., object], *args: object, **kwargs: object) -> float:
    t0 = CLOCK()
    fn(*args, **kwargs)
    return CLOCK() - t0


def generation(
    hf: torch.nn.Module, ours: torch.nn.Module, *, vocab: int, new: int, repeats: int
) -> list[str]:
    rows = []
    for batch in (1, 8):
        ids = torch.randint(2, vocab, (batch, 16), generator=torch.Generator().manual_seed(batch))
        mask = torch.ones_like(ids)
        same = torch.equal(
            ours.generate(ids, 8, attention_mask=mask),  # type: ignore[operator]
            hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False),  # type: ignore[operator]
        )
        a: list[float] = []
        h: list[float] = []
        from attnlab.generation.compiled import compile_report

        with torch.inference_mode():
            # the default path's first call of this shape compiles: timed and reported
            before = len(compile_report(ours))
            first = timed(ours.generate, ids, new, attention_mask=mask)
            compiles = sum(r.seconds for r in compile_report(ours)[before:])
            for _ in range(repeats):  # alternate so that both see the same machine load
                a.append(timed(ours.generate, ids, new, attention_mask=mask))
                h.append(
                    timed(
                        hf.generate, ids, attention_mask=mask, max_new_tokens=new, do_sample=False
                    )
                )
        ta, th = statistics.median(a), statistics.median(h)
        rows.append(
            f"| {vocab} | {batch} | {batch * new / ta:.0f} | {batch * new / th:.0f} | "
            f"{th / ta:.2f}x | {first:.1f} s ({compiles:.1f} s compiling) |"
            + ("" if same else " (outputs differ!)")
        )
    return rows


def per_token(ours: torch.nn.Module, *, contexts: list[int], steps: int) -> list[str]:
    rows = [
        "| context | with cache, ms/token | without cache, ms/token |",
        "|---|---|---|",
    ]
    cached: dict[int, float] = {}
    uncached: dict[int, float] = {}
    with torch.inference_mode():
        for c in contexts:
            ids = torch.randint(2, 1000, (1, c + steps), generator=torch.Generator().manual_seed(c))
            cache = ours.new_cache(max_length=c + steps)  # type: ignore[operator]
            ours(ids[:, :c], past_key_values=cache, logits_to_keep=1)
            ts = [
                timed(ours, ids[:, t : t + 1], past_key_values=cache, logits_to_keep=1)
                for t in range(c, c + steps)
            ]
            full = [timed(ours, ids[:, : c + 1], logits_to_keep=1) for _ in range(2)]
            cached[c] = statistics.median(ts) * 1e3
            uncached[c] = min(full) * 1e3
            rows.append(f"| {c} | {cached[c]:.2f} | {uncached[c]:.1f} |")
    lo, hi = contexts[0], contexts[-1]
    rows.append("")
    rows.append(
        f"Ratio {hi}/{lo}: with cache {cached[hi] / cached[lo]:.2f}, "
        f"without cache {uncached[hi] / uncached[lo]:.1f}."
    )
    return rows


def floor_ms(ours: torch.nn.Module, batch: int, steps: int) -> float:
    """ms per token of the decode step's matmuls alone, on the model's own weights."""
    import torch.nn.functional as F

    weights = [
        (m.weight, m.bias)
        for m in ours.modules()  # q, k, v, o and the MLP's projections of every layer
        if isinstance(m, torch.nn.Linear)
    ]
    head = ours.output_weight  # type: ignore[attr-defined]
    d = head.shape[1]
    x = torch.randn(batch, 1, d)
    acts = {w.shape[1]: torch.randn(batch, 1, w.shape[1]) for w, _ in weights}
    with torch.inference_mode():
        t0 = CLOCK()
        for _ in range(steps):
            for w, b in weights:
                F.linear(acts[w.shape[1]], w, b)
            F.linear(x, head)
        return (CLOCK() - t0) / steps * 1e3


def hf_compiled_step(hf: torch.nn.Module, ids: torch.Tensor, new: int) -> Callable[[], None]:
    """transformers with a static cache and a compiled step (graph breaks allowed), greedy."""
    from transformers import StaticCache

    step = torch.compile(hf.forward, dynamic=False)
    b, p = ids.shape

    def run() -> None:
        cache = StaticCache(config=hf.config, max_cache_len=p + new)  # type: ignore[arg-type]
        with torch.inference_mode():
            out = hf(ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(p))
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            for t in range(p, p + new - 1):
                pos = torch.tensor([t])
                out = step(
                    input_ids=tok,
                    past_key_values=cache,
                    use_cache=True,
                    cache_position=pos,
                    position_ids=pos[None].expand(b, 1),
                )
                tok = out.logits[:, -1].argmax(-1, keepdim=True)

    return run


def floor_table(*, vocabs: list[int], batches: list[int], new: int, repeats: int) -> list[str]:
    rows = [
        "| vocab | batch | floor ms/tok | attnlab eager | attnlab compiled | transformers "
        "generate | transformers static + compiled | compiled vs transformers |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for vocab in vocabs:
        hf, ours = build(new + 32, vocab)
        for batch in batches:
            ids = torch.randint(2, vocab, (batch, 16), generator=torch.Generator().manual_seed(1))
            ref = hf.generate(ids, max_new_tokens=new, do_sample=False)  # type: ignore[operator]
            same = torch.equal(ours.generate(ids, new), ref) and torch.equal(  # type: ignore[operator]
                ours.generate(ids, new, compile=True),  # type: ignore[operator]
                ref,  # compiles the step once, for this shape
            )
            hf_static = hf_compiled_step(hf, ids, new)
            hf_static()  # compile
            runs: dict[str, list[float]] = {k: [] for k in ("floor", "eager", "comp", "hf", "hfc")}
            with torch.inference_mode():
                for _ in range(repeats):  # alternate: every peer sees the same load
                    runs["floor"].append(floor_ms(ours, batch, new))
                    runs["eager"].append(timed(ours.generate, ids, new) / new * 1e3)
                    runs["comp"].append(timed(ours.generate, ids, new, compile=True) / new * 1e3)
                    runs["hf"].append(
                        timed(hf.generate, ids, max_new_tokens=new, do_sample=False) / new * 1e3
                    )
                    runs["hfc"].append(timed(hf_static) / new * 1e3)
            m = {k: statistics.median(v) for k, v in runs.items()}
            f = m["floor"]
            rows.append(
                f"| {vocab} | {batch} | {f:.2f} | {m['eager']:.2f} ({m['eager'] / f:.2f}x) | "
                f"{m['comp']:.2f} ({m['comp'] / f:.2f}x) | {m['hf']:.2f} ({m['hf'] / f:.2f}x) | "
                f"{m['hfc']:.2f} ({m['hfc'] / f:.2f}x) | {m['hf'] / m['comp']:.2f}x |"
                + ("" if same else " (tokens differ!)")
            )
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument(
        "--vocabs", type=int, nargs="+", default=[32000, 4096], help="vocabulary sizes to compare"
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall-clock time, or this process's CPU time (with --threads 1, robust to other "
        "processes competing for the cores)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per context")
    p.add_argument("--update-docs", action="store_true", help=f"write the tables to {DOCS}")
    p.add_argument("--floor", action="store_true", help="the decode table against the floor")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = p.parse_args()
    global CLOCK
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        CLOCK = time.process_time
    if args.floor:
        rows = floor_table(
            vocabs=args.vocabs, batches=args.batches, new=args.new_tokens, repeats=args.repeats
        )
        env = f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.clock} clock"
        text = "\n".join(
            [
                "Greedy decoding, random Llama (4 layers, hidden 256, 8 heads, 2 KV heads), "
                f"prompt 16, {args.new_tokens} new tokens, ms per token (ratio to the floor), "
                f"median of {args.repeats} alternating runs ({env}):",
                "",
                *rows,
            ]
        )
        print(text)
        if args.update_docs:
            write_docs(
                text,
                command="python benchmarks/decode.py " + " ".join(sys.argv[1:]),
                heading=FLOOR_HEADING,
            )
        return
    gen = [
        "| vocab | batch | attnlab tok/s | transformers tok/s | ratio | attnlab first call |",
        "|---|---|---|---|---|---|",
    ]
    for vocab in args.vocabs:
        hf, ours = build(args.new_tokens + 32, vocab)
        gen += generation(hf, ours, vocab=vocab, new=args.new_tokens, repeats=args.repeats)
    _, ours = build(max(args.contexts) + args.steps + 1, args.vocabs[0])
    tok = per_token(ours, contexts=args.contexts, steps=args.steps)
    env = (
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.clock} clock, "
        f"{platform.processor() or platform.machine()}"
    )
    text = "\n".join(
        [
            "Greedy generation, random Llama (4 layers, hidden 256, 8 heads, 2 KV heads), "
            f"prompt 16 tokens, {args.new_tokens} new tokens, float32, median of "
            f"{args.repeats} alternating runs ({env}):",
            "",
            *gen,
            "",
            f"attnlab per-token decode time (vocab {args.vocabs[0]}, batch 1, median of "
            f"{args.steps} steps), with the KV "
            "cache vs recomputing the prefix:",
            "",
            *tok,
        ]
    )
    print(text)
    if args.update_docs:
        write_docs(text, command="python benchmarks/decode.py " + " ".join(sys.argv[1:]))


def write_docs(body: str, *, command: str, heading: str = HEADING) -> None:
    doc = DOCS.read_text()
    if heading not in doc:
        doc = doc.rstrip() + f"\n\n{heading}\n"
    start = doc.index(heading) + len(heading)
    nxt = doc.find("\n## ", start)
    end = len(doc) if nxt < 0 else nxt
    section = f"\n\nCommand: `{command}`\n\n{body}\n"
    DOCS.write_text(doc[:start] + section + doc[end:])


if __name__ == "__main__":
    main()
