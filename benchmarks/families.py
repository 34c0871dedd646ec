"""The model families of issue 25: Gemma-2-shaped prefill and Qwen3 decode.

1. ``prefill``: a Gemma-2-shaped model (8 layers, hidden 512, 8 heads of 64, 4 key/value
   heads, window 1024 on alternate layers), prefill of 8192 tokens, last token's logits:
   attnlab against transformers' sdpa path on the same weights, alternating. The local
   layers are ``sliding_window(1023)`` patterns that attnlab's block-skipping backend runs
   band by band; transformers' sdpa gets a dense 8192 x 8192 mask there. transformers'
   Gemma 2 refuses sdpa because sdpa cannot soft-cap, so the timed model has the soft-caps
   off (``attn_logit_softcapping=None``, ``final_logit_softcapping=None``) and is switched
   to sdpa after construction; everything else is Gemma 2 (sandwich norms, scaled
   embeddings, ``query_pre_attn_scalar``, GeGLU).
2. ``encoder``: a ModernBERT-shaped encoder (6 layers, hidden 384, 6 heads, GeGLU 576,
   local windows of 128 with a global layer every third) on 64 rows of mixed lengths
   (uniform in 16..512): attnlab's unpadded forward (``unpad=True``: the real tokens
   packed into rows with a ``document`` pattern, no compute on padding) against
   transformers' padded forward (sdpa), same weights, states compared at the real tokens.
3. ``memory``: the peak memory of the Gemma-2-shaped prefill at ``--seq-len`` (8192), each
   side in a fresh process (``ru_maxrss`` after the forward less before it: glibc keeps
   freed buffers, so the peak is what the process ever held): attnlab (its local layers on
   a block-skipping backend) against transformers' sdpa, which gets a dense
   8192 x 8192 mask on the local layers; beside the cost model's figures for both.
4. ``decode``: greedy tokens/s of a Qwen3-shaped decoder (per-head QK-norm) against the
   Llama-shaped decoder of the same size and vocabulary (32000), both attnlab, alternating.

Usage::

    python benchmarks/families.py prefill --seq-len 8192 --repeats 3 [--update-docs]
    python benchmarks/families.py encoder --repeats 3 [--update-docs]
    python benchmarks/families.py memory --seq-len 8192 [--update-docs]
    python benchmarks/families.py decode --repeats 5 [--update-docs]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attnlab
from _common import time_interleaved, write_section

PREFILL_HEADING = "## Gemma-2-shaped prefill (issue 25)"
DECODE_HEADING = "## Qwen3 decode against Llama decode (issue 25)"
ENCODER_HEADING = "## ModernBERT-shaped encoder, unpadded against padded (issue 25)"
MEMORY_HEADING = "## Gemma-2-shaped prefill memory at 8192 (issue 25)"
_MEMORY_CHILD = r"""
import json, resource, sys, torch
sys.path.insert(0, sys.argv[3])
torch.set_num_threads(1)
from transformers import Gemma2Config, Gemma2ForCausalLM
import attnlab
from families import GEMMA
side, n = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
hf = Gemma2ForCausalLM(Gemma2Config(**GEMMA, max_position_embeddings=n, attn_implementation="eager")).eval()
model = attnlab.from_hf(hf) if side == "attnlab" else hf
if side != "attnlab":
    hf.config._attn_implementation = "sdpa"
ids = torch.randint(3, 1000, (1, n), generator=torch.Generator().manual_seed(1))
with torch.inference_mode():
    model(ids[:, :64], logits_to_keep=1)  # warm up at a small length
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model(ids, logits_to_keep=1)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"before_kib": before, "peak_kib": after}))
"""
GEMMA = dict(
    vocab_size=1000,
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    query_pre_attn_scalar=64,
    sliding_window=1024,
    attn_logit_softcapping=None,
    final_logit_softcapping=None,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def machine() -> str:
    flags = ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        line = next((x for x in out.splitlines() if x.startswith("Flags")), "")
        keep = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
        flags = " ".join(f for f in line.split() if f in keep)
    except OSError:
        pass
    load = os.getloadavg()[0]
    return (
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), load average "
        f"{load:.1f}, CPU flags: {flags or 'unknown'}"
    )


def prefill(args: argparse.Namespace) -> str:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(**GEMMA, max_position_embeddings=args.seq_len, attn_implementation="eager")
    hf = Gemma2ForCausalLM(cfg).eval()
    ours = attnlab.from_hf(hf)
    hf.config._attn_implementation = "sdpa"  # exact here: no soft-cap to apply
    ids = torch.randint(3, 1000, (1, args.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        a = ours(ids, logits_to_keep=1).logits
        b = hf(ids, logits_to_keep=1).logits
        diff = float((a - b).abs().max())
        groups = ours.explain_attention(ids)  # type: ignore[operator]
        clock = time.process_time if args.clock == "cpu" else time.perf_counter
        times = time_interleaved(
            {
                "attnlab": lambda: ours(ids, logits_to_keep=1),
                "transformers (sdpa)": lambda: hf(ids, logits_to_keep=1),
            },
            rounds=args.repeats,
            warmup=0,
            clock=clock,
        )
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    ref = med["transformers (sdpa)"]
    rows = ["| | forward, s | speed-up |", "|---|---|---|"]
    rows += [f"| {k} | {v:.2f} | {ref / v:.2f}x |" for k, v in med.items()]
    chosen = ", ".join(
        f"layers {list(g.layers)} ({'window ' + str(g.window) if g.window else 'global'}): "
        f"`{g.explanation.chosen}`"
        for g in groups
    )
    return "\n".join(
        [
            f"Command: `python benchmarks/families.py prefill --seq-len {args.seq_len} "
            f"--repeats {args.repeats} --clock {args.clock} --threads {torch.get_num_threads()}`",
            "",
            f"Gemma-2-shaped prefill (8 layers, hidden 512, 8 heads, 4 KV heads, window 1024 "
            f"on layers 0, 2, 4, 6), {args.seq_len} tokens, batch 1, float32, last token's "
            f"logits, median of {args.repeats} alternating runs, {args.clock} clock; "
            f"{machine()}; backends: {chosen}; max |logit difference| {diff:.2e}:",
            "",
            *rows,
        ]
    )


def encoder(args: argparse.Namespace) -> str:
    from transformers import ModernBertConfig, ModernBertModel

    torch.manual_seed(0)
    cfg = ModernBertConfig(
        vocab_size=1000,
        hidden_size=384,
        intermediate_size=576,
        num_hidden_layers=6,
        num_attention_heads=6,
        max_position_embeddings=512,
        local_attention=128,
        global_attn_every_n_layers=3,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    hf = ModernBertModel(cfg).eval()
    ours = attnlab.from_hf(hf)
    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(16, 513, (64,), generator=g)
    ids = torch.randint(3, 1000, (64, int(lengths.max())), generator=g)
    mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    keep = mask.bool()
    with torch.inference_mode():
        a = ours(input_ids=ids, attention_mask=mask, unpad=True).last_hidden_state
        b = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        diff = float((a[keep] - b[keep]).abs().max())
        clock = time.process_time if args.clock == "cpu" else time.perf_counter
        times = time_interleaved(
            {
                "attnlab, unpadded": lambda: ours(input_ids=ids, attention_mask=mask, unpad=True),
                "attnlab, padded": lambda: ours(input_ids=ids, attention_mask=mask),
                "transformers, padded (sdpa)": lambda: hf(input_ids=ids, attention_mask=mask),
            },
            rounds=args.repeats,
            warmup=0,
            clock=clock,
        )
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    ref = med["transformers, padded (sdpa)"]
    rows = ["| | forward, s | speed-up |", "|---|---|---|"]
    rows += [f"| {k} | {v:.2f} | {ref / v:.2f}x |" for k, v in med.items()]
    real, padded = int(mask.sum()), mask.numel()
    return "\n".join(
        [
            f"Command: `python benchmarks/families.py encoder --repeats {args.repeats} "
            f"--clock {args.clock} --threads {torch.get_num_threads()}`",
            "",
            f"ModernBERT-shaped encoder (6 layers, hidden 384, 6 heads, GeGLU 576, windows of "
            f"128 with layers 0 and 3 global), 64 rows of 16..512 tokens ({real} real tokens "
            f"of {padded} padded), float32, median of {args.repeats} alternating runs, "
            f"{args.clock} clock; {machine()}; max |state difference| at real tokens "
            f"{diff:.2e}:",
            "",
            *rows,
        ]
    )


def _decoders(vocab: int) -> dict[str, Any]:
    from attnlab.models import DecoderLM
    from attnlab.models.decoder_config import DecoderConfig

    size: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    out = {}
    for name, preset in (
        ("Llama-shaped", DecoderConfig.llama),
        ("Qwen3-shaped", DecoderConfig.qwen3),
    ):
        torch.manual_seed(0)
        out[name] = DecoderLM(preset(**size)).eval()
    return out


def memory(args: argparse.Namespace) -> str:
    import json

    from attnlab.analysis.cost import estimate
    from attnlab.models.decoder_config import DecoderConfig

    here = str(Path(__file__).resolve().parent)
    extra: dict[str, float] = {}
    for side in ("attnlab", "transformers (sdpa, dense mask)"):
        key = "attnlab" if side == "attnlab" else "hf"
        out = subprocess.run(
            [sys.executable, "-c", _MEMORY_CHILD, key, str(args.seq_len), here],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        got = json.loads(out.strip().splitlines()[-1])
        extra[side] = (got["peak_kib"] - got["before_kib"]) / 1024
    cfg = DecoderConfig.gemma2(
        window=1024,
        vocab_size=1000,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    )
    est = estimate(cfg, seq_len=args.seq_len)
    dense = estimate(cfg, seq_len=args.seq_len, backend="reference")
    rows = ["| | peak extra memory of the forward, MiB |", "|---|---|"]
    rows += [f"| {k} | {v:.0f} |" for k, v in extra.items()]
    ratio = extra["transformers (sdpa, dense mask)"] / max(extra["attnlab"], 1e-9)
    return "\n".join(
        [
            f"Command: `python benchmarks/families.py memory --seq-len {args.seq_len}`",
            "",
            f"Gemma-2-shaped prefill (as above, window 1024 on alternate layers) of "
            f"{args.seq_len} tokens, batch 1, float32, each side in a fresh process, 1 thread: "
            "`ru_maxrss` after the forward less after a 64-token warm-up; "
            f"{machine()}:",
            "",
            *rows,
            "",
            f"attnlab holds **{ratio:.1f}x** less. The cost model (`attnlab.estimate`, which "
            f"costs the local and global layers as two groups) gives "
            f"{est.activation_bytes / 2**20:.0f} MiB of activations for attnlab's choice "
            f"(`{est.backend}`) and {dense.activation_bytes / 2**20:.0f} MiB with the score "
            "matrix materialised on every layer (the dense-mask figure).",
        ]
    )


def decode(args: argparse.Namespace) -> str:
    models = _decoders(32000)
    rows = [
        "| batch | Llama-shaped, tok/s | Qwen3-shaped, tok/s | Qwen3 / Llama |",
        "|---|---|---|---|",
    ]
    for batch in (1, 8):
        ids = torch.randint(3, 32000, (batch, 16), generator=torch.Generator().manual_seed(batch))
        with torch.inference_mode():
            times = time_interleaved(
                {k: (lambda m=m, ids=ids: m.generate(ids, args.new)) for k, m in models.items()},
                rounds=args.repeats,
                warmup=1,
                clock=time.process_time if args.clock == "cpu" else time.perf_counter,
            )
        tps = {k: batch * args.new / sorted(v)[len(v) // 2] for k, v in times.items()}
        llama, qwen = tps["Llama-shaped"], tps["Qwen3-shaped"]
        rows.append(f"| {batch} | {llama:.0f} | {qwen:.0f} | {qwen / llama:.2f} |")
    return "\n".join(
        [
            f"Command: `python benchmarks/families.py decode --repeats {args.repeats} "
            f"--new {args.new} --clock {args.clock} --threads {torch.get_num_threads()}`",
            "",
            f"Greedy `generate`, {args.new} new tokens after 16, 4 layers, hidden 256, 8 heads, "
            f"2 KV heads, vocab 32000, float32, median of {args.repeats} alternating runs, "
            f"{args.clock} clock; "
            f"{machine()}:",
            "",
            *rows,
        ]
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["prefill", "encoder", "memory", "decode"])
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    p.add_argument("--update-docs", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    run, heading = {
        "prefill": (prefill, PREFILL_HEADING),
        "encoder": (encoder, ENCODER_HEADING),
        "memory": (memory, MEMORY_HEADING),
        "decode": (decode, DECODE_HEADING),
    }[args.what]
    body = run(args)
    print(body)
    if args.update_docs:
        write_section(heading, body)


if __name__ == "__main__":
    main()
