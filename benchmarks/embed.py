"""Sentence embeddings: attnlab's ``encode`` vs sentence-transformers, and the padded-batch forward.

Three measurements, each against its peer in the same process, alternating rounds:

1. **Corpus**: ``--texts`` texts from the Python standard library's source (docstrings'
   first paragraphs and comment sentences, a fixed seeded sample), encoded by
   sentence-transformers' ``encode`` (batch 32, float32) and by attnlab's
   ``EncoderModel.encode`` (batch 32, float32, ``strategy="auto"``). Reports texts/s,
   the ratio, the max difference per component, and the *matmul floor*: the layers'
   own ``F.linear`` calls on the real tokens only (no padding), called bare.
2. **Padded batch**: 32 random-token sentences of lengths drawn uniformly from 8..128
   (seed 0), padded to the longest: transformers' ``BertModel`` (sdpa) vs attnlab's
   forward with ``unpad=True``; the real tokens' states are compared.
3. **bfloat16**: attnlab's ``encode`` in bfloat16 (autocast) vs float32 on the corpus:
   texts/s and the smallest cosine similarity to the float32 embeddings.

    python benchmarks/embed.py [--texts 512] [--rounds 3] [--threads N] [--write]
"""

from __future__ import annotations

import argparse
import ast
import os
import random
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
import torch.nn.functional as F

import attnlab
from _common import machine_line, median_ms, time_interleaved, write_section
from attnlab.interop.pretrained import minilm_path


def stdlib_corpus(n: int, seed: int = 0) -> list[str]:
    """``n`` texts from the standard library's source: docstring paragraphs and comment lines.

    Files are read in sorted order and the sample is drawn with a fixed seed, so the corpus
    is the same on every machine with the same Python version.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    for path in sorted(root.glob("*.py")):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc:
                    para = " ".join(doc.split("\n\n")[0].split())
                    if len(para) > 10:
                        texts.append(para)
        for line in source.splitlines():
            s = line.strip()
            if s.startswith("# ") and len(s) > 30:
                texts.append(s[2:])
    rng = random.Random(seed)
    return rng.sample(texts, n)


def linear_floor(
    model: torch.nn.Module, tokens: int, rounds: int, clock=time.perf_counter
) -> float:
    """Seconds of the layers' own matmuls on ``tokens`` real tokens, called bare."""
    weights = []
    for layer in model.layers:
        a, f = layer.attention, layer.feed_forward
        weights += [a.q_proj, a.k_proj, a.v_proj, a.out_proj, f.fc_in, f.fc_out]
    x = torch.randn(tokens, model.config.hidden_size)
    h = torch.randn(tokens, model.config.intermediate_size)

    def run() -> None:
        for lin in weights:
            F.linear(h if lin.in_features != x.shape[-1] else x, lin.weight, lin.bias)

    with torch.inference_mode():
        run()
        best = float("inf")
        for _ in range(rounds):
            t0 = clock()
            run()
            best = min(best, clock() - t0)
    return best


def _cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux), or an empty set."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--texts", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall-clock time, or this process's CPU time (with --threads 1: robust to other load)",
    )
    ap.add_argument("--skip", default="", help="comma list of parts to skip: corpus,padded,bf16")
    ap.add_argument("--write", action="store_true", help="write docs/benchmarks.md's section")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    skip = set(filter(None, args.skip.split(",")))
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    import transformers
    from sentence_transformers import SentenceTransformer

    path = minilm_path()
    ours = attnlab.from_hf(path)
    st = SentenceTransformer(str(path), device="cpu")
    corpus = stdlib_corpus(args.texts)
    lines = [f"all-MiniLM-L6-v2, float32 unless said, inference; {machine_line()}."]

    if "corpus" not in skip:
        emb, report = ours.encode(corpus, batch_size=32, return_report=True)
        ref = st.encode(corpus, batch_size=32, convert_to_tensor=True)
        diff = (emb - ref).abs().max().item()
        times = time_interleaved(
            {
                "sentence-transformers encode": lambda: st.encode(corpus, batch_size=32),
                "attnlab encode": lambda: ours.encode(corpus, batch_size=32),
            },
            rounds=args.rounds,
            clock=clock,
        )
        st_s = median_ms(times["sentence-transformers encode"]) / 1e3
        our_s = median_ms(times["attnlab encode"]) / 1e3
        floor = linear_floor(ours, report.real_tokens, args.rounds, clock)
        table = "\n".join(
            [
                "| implementation | median s | texts/s | ratio |",
                "|---|---|---|---|",
                f"| sentence-transformers encode (batch 32) | {st_s:.2f} | {len(corpus) / st_s:.0f} | 1.00 |",
                f"| attnlab encode (batch 32, {report.strategy}) | {our_s:.2f} | "
                f"{len(corpus) / our_s:.0f} | {st_s / our_s:.2f} |",
                f"| matmul floor: the layers' F.linear on the {report.real_tokens:,} real tokens "
                f"| {floor:.2f} | {len(corpus) / floor:.0f} | {st_s / floor:.2f} |",
            ]
        )
        text = (
            f"### Corpus: {len(corpus)} texts from the standard library\n\n{table}\n\n"
            f"attnlab is {our_s / floor:.2f}x its matmul floor, sentence-transformers "
            f"{st_s / floor:.2f}x. Max |attnlab - sentence-transformers| per component: "
            f"{diff:.1e}. attnlab's report:\n\n```\n{report}\n```"
        )
        print(text)
        lines.append(text)

    if "padded" not in skip:
        hf = transformers.BertModel.from_pretrained(path, attn_implementation="sdpa").eval()
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(8, 129, (32,), generator=g)
        width = int(lengths.max())
        ids = torch.randint(1000, 30000, (32, width), generator=g)
        mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        ids = ids * mask
        with torch.inference_mode():
            want = hf(input_ids=ids, attention_mask=mask).last_hidden_state
            got = ours(input_ids=ids, attention_mask=mask, unpad=True).last_hidden_state
            plain = ours(input_ids=ids, attention_mask=mask).last_hidden_state
            real = mask.bool()
            diff = (got - want)[real].abs().max().item()
            times = time_interleaved(
                {
                    "transformers BertModel (sdpa)": lambda: hf(input_ids=ids, attention_mask=mask),
                    "attnlab, padded": lambda: ours(input_ids=ids, attention_mask=mask),
                    "attnlab, unpad=True": lambda: ours(
                        input_ids=ids, attention_mask=mask, unpad=True
                    ),
                },
                rounds=args.rounds * 3,
                clock=clock,
            )
        del plain
        peer = median_ms(times["transformers BertModel (sdpa)"])
        rows = ["| implementation | median ms | speed-up vs transformers |", "|---|---|---|"]
        rows += [
            f"| {name} | {median_ms(ts):.1f} | {peer / median_ms(ts):.2f} |"
            for name, ts in times.items()
        ]
        text = (
            f"### Padded batch: 32 sentences, lengths uniform in 8..128 (seed 0), padded to "
            f"{width}; {int(mask.sum())} real tokens of {mask.numel()}\n\n"
            + "\n".join(rows)
            + f"\n\nmax |attnlab - transformers| on real tokens: {diff:.1e}."
        )
        print(text)
        lines.append(text)

    if "bf16" not in skip:
        f32 = ours.encode(corpus, batch_size=32)
        b16 = ours.encode(corpus, batch_size=32, dtype=torch.bfloat16)
        cos = F.cosine_similarity(f32, b16.float(), dim=-1)
        times = time_interleaved(
            {
                "attnlab encode float32": lambda: ours.encode(corpus, batch_size=32),
                "attnlab encode bfloat16": lambda: ours.encode(
                    corpus, batch_size=32, dtype=torch.bfloat16
                ),
            },
            rounds=args.rounds,
            clock=clock,
        )
        a, b = (median_ms(ts) / 1e3 for ts in times.values())
        # The GEMM itself: is bfloat16 native on this CPU? (the encoder's FFN up-projection)
        x32, w32 = torch.randn(2048, 384), torch.randn(1536, 384)
        x16, w16 = x32.bfloat16(), w32.bfloat16()
        gemm = time_interleaved(
            {
                "float32": lambda: F.linear(x32, w32),
                "bfloat16": lambda: F.linear(x16, w16),
            },
            rounds=max(3, args.rounds),
            clock=clock,
        )
        g32, g16 = (median_ms(ts) for ts in gemm.values())
        flags = _cpu_flags()
        native = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
        text = (
            "### bfloat16 (autocast) vs float32, same corpus\n\n"
            "| dtype | median s | texts/s |\n|---|---|---|\n"
            f"| float32 | {a:.2f} | {len(corpus) / a:.0f} |\n"
            f"| bfloat16 | {b:.2f} | {len(corpus) / b:.0f} |\n\n"
            f"bfloat16 is {a / b:.2f}x float32's speed; cosine to float32: min {cos.min():.5f}, "
            f"mean {cos.mean():.5f}. The GEMM alone (`F.linear`, 2048 x 384 by 1536 x 384, "
            f"bare): float32 {g32:.1f} ms, bfloat16 {g16:.1f} ms ({g32 / g16:.2f}x); native "
            f"bfloat16 instructions on this CPU: {', '.join(native) or 'none'}."
        )
        print(text)
        lines.append(text)

    if args.write:
        cmd = f"python benchmarks/embed.py --texts {args.texts} --rounds {args.rounds}"
        cmd += f" --threads {args.threads}" if args.threads else ""
        cmd += f" --clock {args.clock}"
        cmd += f" --skip {args.skip}" if args.skip else ""
        write_section(
            "## Sentence embeddings (issue 15)",
            f"Command: `{cmd} --write` (from benchmarks/, PYTHONPATH=src), {args.clock} clock. "
            "Taken on the shared 2-core machine while the other engineers' jobs ran (load "
            "average above 10): absolute times are noisy; the ratios come from interleaved "
            "rounds in one process.\n\n" + "\n\n".join(lines),
        )


if __name__ == "__main__":
    main()
