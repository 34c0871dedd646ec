"""The cost of grammar-constrained decoding (structured outputs) on SmolLM2-135M-Instruct.

Two measurements, each alternating its candidates in one run:

* ``single``: one greedy chat request under a JSON schema (three capitals and their
  countries) against the same request unconstrained, held to the same number of
  generated tokens (``ignore_eos``), so both run the same steps; tokens/s of the whole
  request (prefill included) and the ratio (target: constrained within 1.3x). The time
  llguidance spends computing masks is counted separately.
* ``batch``: four unconstrained requests alone, and the same four beside one
  constrained request in the same batches: their tokens must be identical, and their
  step time is compared.

Usage::

    python benchmarks/structured.py [--rounds 5] [--clock wall|cpu] [--update-docs]

``--clock cpu`` times with ``time.process_time`` (the CPU seconds of every thread of the
process, llguidance's mask threads included): on a shared, loaded machine the wall clock
measures the queue, the CPU clock the work.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attnlab
import attnlab.generation.grammar as grammar_mod
from _common import machine_line, write_section
from attnlab.generation.grammar import Grammar
from attnlab.interop.pretrained import smollm2_path
from attnlab.serving import Engine, SamplingParams

HEADING = "## Structured outputs (issue 24)"
SCHEMA = {
    "type": "object",
    "properties": {
        "capitals": {
            "type": "array",
            "minItems": 3,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 24},
                    "country": {"type": "string", "maxLength": 24},
                },
                "required": ["city", "country"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["capitals"],
    "additionalProperties": False,
}
ASK = "List three European capitals with their countries, as JSON."
CLOCK: list[Any] = [time.perf_counter]  # set from --clock


class _MaskClock:
    """Seconds spent in llguidance's mask computation (wraps ``fill_bitmask``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._real = grammar_mod.fill_bitmask

    def __enter__(self) -> _MaskClock:
        real = self._real

        def timed(matchers: list[Any]) -> Any:
            t0 = CLOCK[0]()
            out = real(matchers)
            self.seconds += CLOCK[0]() - t0
            self.calls += 1
            return out

        grammar_mod.fill_bitmask = timed  # step_sampling imports it at call time
        return self

    def __exit__(self, *exc: object) -> None:
        grammar_mod.fill_bitmask = self._real


def _run(
    engine: Engine, prompt: list[int], params: list[SamplingParams]
) -> tuple[float, list[Any]]:
    t0 = CLOCK[0]()
    out = engine.generate([prompt] * len(params), params)
    return CLOCK[0]() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--update-docs", action="store_true")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = ap.parse_args()
    CLOCK[0] = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.manual_seed(0)
    model = attnlab.from_gguf(smollm2_path())
    tok = model.tokenizer
    engine = Engine(model, tok, num_blocks=512, max_model_len=1024)
    text = tok.apply_chat_template(
        [{"role": "user", "content": ASK}], add_generation_prompt=True, tokenize=False
    )
    prompt = list(tok.encode(text, add_special_tokens=False))
    g = Grammar.json_schema(SCHEMA, tok, engine.vocab_size)
    constrained = SamplingParams(max_tokens=200, temperature=0, grammar=g)
    _, first = _run(engine, prompt, [constrained])
    n = len(first[0][0].token_ids)
    answer = first[0][0].text
    free = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)

    times: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    masks = _MaskClock()
    for _ in range(args.rounds):
        times["unconstrained"].append(_run(engine, prompt, [free])[0])
        with masks:
            seconds, out = _run(engine, prompt, [constrained])
        times["json_schema"].append(seconds)
        assert out[0][0].text == answer
    print("single done", flush=True)
    tps = {k: n / statistics.median(v) for k, v in times.items()}
    ratio = tps["unconstrained"] / tps["json_schema"]
    mask_ms = 1000 * masks.seconds / max(masks.calls, 1)

    # four unconstrained requests, alone and beside a constrained one
    four = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)] * 4
    alone_t: list[float] = []
    mixed_t: list[float] = []
    alone_out = mixed_out = None
    for _ in range(2):
        t, alone_out = _run(engine, prompt, four)
        alone_t.append(t)
        t, mixed_out = _run(engine, prompt, [*four, constrained])
        mixed_t.append(t)
    assert alone_out is not None and mixed_out is not None
    same = [c[0].token_ids for c in alone_out] == [c[0].token_ids for c in mixed_out[:4]]
    batch_ratio = statistics.median(mixed_t) / statistics.median(alone_t)

    load = os.getloadavg()
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f" {f}" in flags]
    body = f"""\
`python benchmarks/structured.py --rounds {args.rounds} --clock {args.clock}` on {machine_line()}; CPU flags
{", ".join(isa)}; load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (a shared machine:
alternated rounds, medians; {args.clock} clock). SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to float32), one
greedy chat request for three capitals as JSON under a schema, {n} tokens, prefill included.

| request | tokens/s ({args.clock} clock) | ratio |
|---|---|---|
| unconstrained ({n} tokens, `ignore_eos`) | {tps["unconstrained"]:.1f} | 1.00 |
| `response_format` json_schema (llguidance) | {tps["json_schema"]:.1f} | {ratio:.2f} |

- llguidance's mask per step: {mask_ms:.3f} ms ({masks.calls} steps measured); the rest of
  the difference: the bitmask's unpacking and masking of the constrained row, and noise.
- Target "within 1.3x": {"met" if ratio <= 1.3 else "missed"} ({ratio:.2f}x).
- Four unconstrained requests beside one constrained request in the same batches: tokens
  {"identical" if same else "DIFFERENT"} to the four alone; the mixed run took
  {batch_ratio:.2f}x the time of the four alone (it also decodes a fifth sequence).
- The constrained answer: `{answer}`
"""
    print(body)
    if args.update_docs:
        write_section(HEADING, body)


if __name__ == "__main__":
    main()
