"""LoRA SFT of SmolLM2-135M-Instruct on questions about the standard library's docstrings.

The instruction set is built here from what every machine has: for public functions and
classes of a fixed list of standard-library modules, "What does `module.name` do?" is
answered by the first paragraph of the docstring. ``attnlab finetune`` holds 10 % of the
rows out (by a hash of each row); this script reports the held-out loss before and after,
three held-out answers before and after (greedy), wall time and peak memory, and writes
``report.json`` beside the run.

    python scripts/sft_smollm2.py --out runs/smollm2-lora [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def _answer(model, tok, question: str, max_new_tokens: int) -> str:
    import torch

    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id)
    return str(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)).strip()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="runs/smollm2-lora")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-len", type=int, default=192)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--qlora", action="store_true")
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=48)
    args = p.parse_args()

    import attnlab
    from attnlab.interop.pretrained import smollm2_path
    from attnlab.train.finetune import FinetuneConfig, _split, finetune
    from attnlab.train.instructions import stdlib_docstring_rows

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = stdlib_docstring_rows()
    data = out / "stdlib_docstrings.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, held = _split(rows, 10)
    questions = [str(r["messages"][0]["content"]) for r in held[: args.samples]]  # type: ignore[index]
    truth = [str(r["messages"][1]["content"]) for r in held[: args.samples]]  # type: ignore[index]
    gguf = smollm2_path()
    t0 = time.perf_counter()
    base = attnlab.from_gguf(gguf)
    print(f"loaded {gguf.name} in {time.perf_counter() - t0:.0f} s; {len(rows)} rows", flush=True)
    before = [_answer(base, base.tokenizer, q, args.max_new_tokens) for q in questions]
    del base
    config = FinetuneConfig(
        model=str(gguf), data=str(data), out_dir=str(out), lora_rank=args.rank,
        lora_alpha=2.0 * args.rank, lora_dropout=0.05, qlora=args.qlora, max_len=args.max_len,
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup_steps=5,
        eval_every=args.eval_every, progress=False,
    )  # fmt: skip
    summary = finetune(config)
    merged = attnlab.from_hf(out / "merged")
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(out / "merged"))
    after = [_answer(merged, tok, q, args.max_new_tokens) for q in questions]
    report = {
        "rows": len(rows),
        "summary": summary,
        "samples": [
            {"question": q, "reference": t, "before": b, "after": a}
            for q, t, b, a in zip(questions, truth, before, after)
        ],
        "script_seconds": time.perf_counter() - t0,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
