"""Paged serving: KV waste, throughput against transformers, sharing for n > 1, a loopback load test.

Parts (``--part``, default all), each measured in one run with its peers:

* ``waste``: KV memory waste (allocated slots holding no token / allocated slots, sampled
  at every engine step and averaged) on a mixed workload (prompts 16-1024, outputs
  16-512, seed 0), against a contiguous cache preallocated to the maximum length, and
  against one preallocated to each request's own prompt + max_tokens. Waste depends on
  token counts only, so a tiny model runs the schedule.
* ``throughput``: 64 mixed-length requests through the Llama-shaped model of the issue
  (hidden 512, 8 layers, 8 heads, 2 key/value heads, vocab 32000, random weights,
  float32): attnlab's engine vs transformers' continuous batching (``generate_batch``),
  ``generate`` request by request, and ``generate`` on padded static batches of 16;
  greedy tokens compared.
* ``sharing``: ``n = 4`` choices of a 512-token prompt with 64-token outputs: peak KV
  blocks against four independent sequences (prefix caching off).
* ``load``: 64 concurrent streaming clients (the official ``openai`` client) against
  ``attnlab serve``'s app on 127.0.0.1, two identical rounds: none lost or corrupted,
  p50/p99 time to first token and inter-token latency, all blocks free afterwards,
  resident memory after each round; then the same load against ``transformers serve``
  when it can run; and a plot of KV blocks over time.

Scaled for a shared 2-core CPU: see ``--requests``, ``--max-new`` and the docstring of
each part; ``docs/benchmarks.md`` states the scale of the recorded run.

Usage::

    python benchmarks/serving.py [--part waste|throughput|sharing|load] [--update-docs]
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DOCS, machine_line, write_section
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.serving import BackgroundServer, Engine, SamplingParams

HEADING = "## Paged serving (issue 10)"
PLOT = DOCS.parent / "serving_kv_blocks.png"


class IdTokenizer:
    """Token ids as text (``"12 7 3"``): a tokenizer for models without one."""

    eos_token_id = None
    chat_template = None

    def encode(self, text: str, **_: Any) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join(f" {i}" for i in ids)


def tiny_model(vocab: int = 512, max_len: int = 1600) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(
        DecoderConfig.llama(
            vocab_size=vocab,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=64,
            max_position_embeddings=max_len,
        )
    ).eval()


def llama_512(
    max_len: int = 2048, *, hidden: int = 512, layers: int = 8, heads: int = 8, ffn: int = 1376
) -> tuple[Any, DecoderLM]:
    """The issue's Llama shape in transformers (smaller with the keywords), and the same
    weights in attnlab."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import attnlab

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        max_position_embeddings=max_len,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )
    hf = LlamaForCausalLM(cfg).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf, attnlab.from_hf(hf).eval()


# ---------------------------------------------------------------------------- waste


def part_waste(requests: int) -> list[str]:
    rng = random.Random(0)
    max_len = 1024 + 512
    work = [(rng.randint(16, 1024), rng.randint(16, 512)) for _ in range(requests)]
    model = tiny_model(max_len=max_len)
    bs = 16
    engine = Engine(
        model,
        IdTokenizer(),
        num_blocks=requests * max_len // bs,
        block_size=bs,
        max_num_seqs=requests,
        max_num_batched_tokens=2048,
        max_model_len=max_len,
    )
    for i, (p, n) in enumerate(work):
        prompt = [rng.randrange(1, 512) for _ in range(p)]
        engine.add_request(
            str(i), prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        )
    own = {str(i): p + n for i, (p, n) in enumerate(work)}
    paged, contiguous, per_request = [], [], []
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
        running = engine.running
        if not running:
            continue
        stored = engine.pool.stored_slots()
        paged.append(engine.pool.waste())
        contiguous.append(1 - stored / (len(running) * max_len))
        per_request.append(1 - stored / sum(own[s.request.request_id] for s in running))
    secs = time.perf_counter() - t0
    mean = statistics.fmean
    return [
        f"Workload: {requests} requests, prompts uniform in 16-1024, outputs 16-512 (seed 0), "
        f"block size {bs}; {len(paged)} engine steps ({secs:.0f} s with a 1-layer model).",
        "",
        "| KV cache | mean waste over steps |",
        "|---|---|",
        f"| attnlab paged (blocks of {bs}) | **{100 * mean(paged):.2f} %** |",
        f"| contiguous, preallocated to the maximum length {max_len} | {100 * mean(contiguous):.1f} % |",
        f"| contiguous, preallocated to each request's prompt + max_tokens | {100 * mean(per_request):.1f} % |",
    ]


# ---------------------------------------------------------------------------- throughput


def part_throughput(requests: int, max_new: int, batch: int) -> list[str]:
    hf, model = llama_512()
    rng = random.Random(1)
    prompts = [
        [rng.randrange(2, 32000) for _ in range(rng.randint(16, 128))] for _ in range(requests)
    ]
    params = SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True)
    results: dict[str, tuple[float, list[list[int]]]] = {}

    def run_attnlab() -> list[list[int]]:
        engine = Engine(
            model,
            IdTokenizer(),
            num_blocks=requests * 12,
            block_size=16,
            max_num_seqs=requests,
            max_num_batched_tokens=512,
        )
        return [c[0].token_ids for c in engine.generate(prompts, params)]

    def run_generate_batch() -> list[list[int]]:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        cfg = GenerationConfig(
            max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        # the same pool and token budget as the engine (without it, on CPU, transformers
        # sizes its cache from memory it cannot measure without psutil)
        cb = ContinuousBatchingConfig(page_size=16, num_blocks=requests * 12, max_batch_tokens=512)
        out = hf.generate_batch(
            prompts,
            generation_config=cfg,
            continuous_batching_config=cb,
            max_new_tokens=max_new,
            warmup=False,
        )
        by_id = list(out.values())
        by_id.sort(
            key=lambda r: (
                int(str(r.request_id).rsplit("_", 1)[-1])
                if str(r.request_id).rsplit("_", 1)[-1].isdigit()
                else 0
            )
        )
        return [list(r.generated_tokens) for r in by_id]

    def run_one_by_one() -> list[list[int]]:
        outs = []
        for p in prompts:
            ids = torch.tensor([p])
            outs.append(
                hf.generate(ids, max_new_tokens=max_new, do_sample=False)[0, len(p) :].tolist()
            )
        return outs

    def run_static() -> list[list[int]]:
        outs: list[list[int]] = []
        for i in range(0, len(prompts), batch):
            group = prompts[i : i + batch]
            width = max(len(p) for p in group)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False)
            outs += out[:, width:].tolist()
        return outs

    ours_name = "attnlab Engine (continuous batching, paged)"
    cb_name = "transformers generate_batch (continuous batching, paged)"
    runs = {
        ours_name: run_attnlab,
        cb_name: run_generate_batch,
        f"transformers generate, padded static batches of {batch}": run_static,
        "transformers generate, request by request": run_one_by_one,
    }
    # the two continuous batchers twice, alternating; the best time of each counts
    order = [ours_name, cb_name, *list(runs)[2:], ours_name, cb_name]
    with torch.inference_mode():
        for name in order:
            t0 = time.perf_counter()
            try:
                toks = runs[name]()
            except Exception as e:  # a peer that cannot run here is reported, not fatal
                print(f"{name}: failed: {type(e).__name__}: {e}", file=sys.stderr)
                continue
            secs = time.perf_counter() - t0
            print(f"{name}: {secs:.1f} s", file=sys.stderr, flush=True)
            if name not in results or secs < results[name][0]:
                results[name] = (secs, toks)
    ours_s, ours = results["attnlab Engine (continuous batching, paged)"]
    total = requests * max_new
    lines = [
        f"{requests} requests, prompts uniform in 16-128 tokens (seed 1), {max_new} new tokens each "
        f"(greedy), Llama hidden 512 / 8 layers / 8 heads / 2 KV heads / vocab 32000, float32, "
        f"random weights, {torch.get_num_threads()} torch thread(s); one run: attnlab, "
        "generate_batch, static batches, request by request, attnlab, generate_batch; the "
        "best time of each.",
        "",
        "| runner | seconds | generated tokens/s | attnlab speed-up | same greedy tokens |",
        "|---|---|---|---|---|",
    ]
    for name, (secs, toks) in results.items():
        same = sum(a == b for a, b in zip(ours, toks))
        lines.append(
            f"| {name} | {secs:.1f} | {total / secs:.0f} | {secs / ours_s:.2f}x | {same}/{requests} |"
        )
    for name in runs:
        if name not in results:
            lines.append(f"| {name} | could not run here (see stderr of the run) | | | |")
    return lines


# ---------------------------------------------------------------------------- sharing


def part_sharing() -> list[str]:
    model = tiny_model()
    prompt = [random.Random(2).randrange(1, 512) for _ in range(512)]
    peaks = {}
    for name, n, copies, prefix in (
        ("n = 4 (forks share the prompt)", 4, 1, True),
        ("4 independent sequences", 1, 4, False),
    ):
        engine = Engine(
            model,
            IdTokenizer(),
            num_blocks=1024,
            block_size=16,
            prefix_caching=prefix,
            max_num_batched_tokens=2048,
        )
        p = SamplingParams(max_tokens=64, temperature=1.0, seed=0, n=n, ignore_eos=True)
        for c in range(copies):
            engine.add_request(f"r{c}", prompt, p)
        peak = 0
        while engine.has_work():
            engine.step()
            peak = max(peak, engine.pool.num_used_blocks)
        peaks[name] = peak
    a, b = peaks.values()
    per_block = llama_block_bytes()
    return [
        "512-token prompt, 64 new tokens per sequence, blocks of 16.",
        "",
        "| | peak KV blocks | MiB for the Llama-512 model |",
        "|---|---|---|",
        *[f"| {k} | {v} | {v * per_block / 2**20:.1f} |" for k, v in peaks.items()],
        f"| ratio | **{a / b:.3f}x** (target <= 0.4x) | |",
    ]


def llama_block_bytes(block: int = 16) -> int:
    return 2 * 8 * 2 * 64 * block * 4  # k+v, layers, kv heads, head dim, tokens, float32


# ---------------------------------------------------------------------------- load


def _client_run(base_url: str, model: str, prompts: list[str], max_new: int) -> dict[str, Any]:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
    ttft: list[float] = []
    itl: list[float] = []
    texts: dict[int, str] = {}
    errors: list[str] = []

    def one(i: int) -> None:
        try:
            t0 = time.perf_counter()
            last = None
            parts = []
            stream = client.completions.create(
                model=model, prompt=prompts[i], max_tokens=max_new, temperature=0, stream=True
            )
            for chunk in stream:
                if not chunk.choices or not chunk.choices[0].text:
                    continue
                now = time.perf_counter()
                if last is None:
                    ttft.append(now - t0)
                else:
                    itl.append(now - last)
                last = now
                parts.append(chunk.choices[0].text)
            texts[i] = "".join(parts)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    return {
        "ttft": ttft,
        "itl": itl,
        "texts": texts,
        "errors": errors,
        "seconds": time.perf_counter() - t0,
    }


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return 1000 * xs[min(len(xs) - 1, int(q * len(xs)))]


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def part_load(clients: int, max_new: int) -> list[str]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # a smaller Llama than the throughput part's (hidden 128, 2 layers, 4 heads, 2 KV
    # heads, vocab 32000), so that three rounds of 64 clients fit in minutes on this machine
    hf, model = llama_512(hidden=128, layers=2, heads=4, ffn=344)
    # a word-level tokenizer over the first 32000 "words" w0..w31999, so that text prompts
    # map to known ids for both servers
    vocab = {f"w{i}": i for i in range(32000)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0", pad_token="w0")
    rng = random.Random(3)
    prompts = [
        " ".join(f"w{rng.randrange(2, 32000)}" for _ in range(rng.randint(16, 128)))
        for _ in range(clients)
    ]
    engine = Engine(
        model,
        tok,
        num_blocks=clients * 12,
        block_size=16,
        max_num_seqs=clients,
        max_num_batched_tokens=512,
        max_waiting=4 * clients,
    )
    rows = []
    rounds = []
    with BackgroundServer(engine, model_name="llama-512", max_seconds=1800) as srv:
        for _round in range(2):
            res = _client_run(srv.base_url, "llama-512", prompts, max_new)
            deadline = time.monotonic() + 30
            while engine.pool.num_used_blocks and time.monotonic() < deadline:
                time.sleep(0.1)
            res["free_after"] = engine.pool.num_used_blocks == 0
            res["rss"] = _rss_mib()
            rounds.append(res)
        history = list(engine.metrics.history)
    ref = rounds[0]["texts"]
    for r, res in enumerate(rounds):
        corrupted = sum(res["texts"].get(i) != ref.get(i) for i in range(clients))
        rows.append(
            f"| attnlab serve, round {r + 1} | {len(res['texts'])}/{clients} | {len(res['errors'])} | "
            f"{corrupted if r else '-'} | {_pct(res['ttft'], 0.5):.0f} / {_pct(res['ttft'], 0.99):.0f} | "
            f"{_pct(res['itl'], 0.5):.0f} / {_pct(res['itl'], 0.99):.0f} | {res['seconds']:.1f} | "
            f"{'yes' if res['free_after'] else 'NO'} | {res['rss']:.0f} |"
        )
    rows.append(_transformers_serve_row(hf, tok, prompts, clients, max_new))
    _plot(history, engine.pool.num_blocks)
    return [
        f"{clients} concurrent streaming clients (official `openai` client, one thread each) on "
        f"127.0.0.1, prompts 16-128 tokens, {max_new} new tokens each, greedy; a random "
        "Llama (hidden 128, 2 layers, 4 heads, 2 KV heads, vocab 32000); two identical rounds "
        "against one server.",
        "",
        "| server | completed | errors | differing from round 1 | TTFT p50 / p99 ms | "
        "inter-token p50 / p99 ms | wall s | all KV blocks free after | RSS after, MiB |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"![KV blocks in use during the load test]({PLOT.name})",
    ]


def _transformers_serve_row(
    hf: Any, tok: Any, prompts: list[str], clients: int, max_new: int
) -> str:
    import socket

    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        tok.save_pretrained(d)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        exe = Path(sys.executable).with_name("transformers")
        cmd = [
            str(exe),
            "serve",
            d,
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--continuous-batching",
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            import httpx

            deadline = time.monotonic() + 180
            up = False
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    up = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
                except httpx.HTTPError:
                    up = False
                if up:
                    break
                time.sleep(1)
            if not up:
                proc.kill()
                out = (proc.communicate(timeout=10)[0] or "").strip().splitlines()
                why = out[-1] if out else "no output"
                return f"| transformers serve | could not run here: {why[:200]} | | | | | | | |"
            res = _client_run(f"http://127.0.0.1:{port}/v1", d, prompts, max_new)
            return (
                f"| transformers serve --continuous-batching | {len(res['texts'])}/{clients} | "
                f"{len(res['errors'])} {('(' + res['errors'][0][:80] + ')') if res['errors'] else ''} | - | "
                f"{_pct(res['ttft'], 0.5):.0f} / {_pct(res['ttft'], 0.99):.0f} | "
                f"{_pct(res['itl'], 0.5):.0f} / {_pct(res['itl'], 0.99):.0f} | {res['seconds']:.1f} | - | - |"
            )
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()


def _plot(history: list[tuple[float, int, int, float]], total: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    t = [h[0] - history[0][0] for h in history]
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot(t, [h[1] for h in history], label="blocks in use")
    ax.axhline(total, color="grey", linestyle="--", label=f"pool ({total} blocks)")
    ax.set_xlabel("seconds")
    ax.set_ylabel("KV blocks of 16 tokens")
    ax.set_title("KV blocks during two rounds of 64 streaming clients")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["waste", "throughput", "sharing", "load"], action="append")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--static-batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--update-docs", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    parts = args.part or ["waste", "sharing", "throughput", "load"]
    for part in parts:
        print(f"== {part}", file=sys.stderr, flush=True)
        if part == "waste":
            lines = part_waste(args.requests)
        elif part == "throughput":
            lines = part_throughput(args.requests, args.max_new, args.static_batch)
        elif part == "sharing":
            lines = part_sharing()
        else:
            lines = part_load(args.requests, args.max_new)
        print("\n".join(lines), flush=True)
        if args.update_docs:
            cmd = f"python benchmarks/serving.py --part {part} --requests {args.requests} --max-new {args.max_new}"
            if args.threads:
                cmd += f" --threads {args.threads}"
            machine = (
                f"Machine: {machine_line()}; a shared machine, loaded by other runs at the time."
            )
            write_section(
                f"{HEADING}: {part}",
                "\n".join(["", f"Command: `{cmd}`", "", machine, "", *lines, ""]),
            )


if __name__ == "__main__":
    main()
