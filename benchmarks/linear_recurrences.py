"""Linear attention and gated recurrences (issue 27): chunked forms against their step-by-step
recurrences and transformers' torch paths, and decoding/training cost beside attention,
Mamba, RWKV-4 and RetNet.

Two parts, each timed in one run, alternating between the contenders (one thread, process
time: the machine is shared):

1. ``forms``: forward + backward at ``--length`` tokens (default 4096) of each layer's
   chunked form against its one-token-at-a-time recurrence: the delta rule (DeltaNet),
   the gated delta rule (Gated DeltaNet), GLA (4 heads, key/value dim 64), the RG-LRU's
   linear recurrence (``--channels`` wide) and the short convolution; and against
   transformers' own torch paths where they exist: Qwen3-Next's
   ``torch_chunk_gated_delta_rule`` and RecurrentGemma's ``_rnn_scan``.
2. ``table``: decode time per token and state/cache bytes at two contexts (default 256 and
   4096), and a training step (forward + backward, batch 1) at ``--train-length`` tokens,
   for ~10 M-parameter models: the Llama-shaped Transformer, Mamba, RWKV-4 and RetNet of
   ``benchmarks/ssm.py``, and one ``DecoderLM`` per new mixer. The recurrent states are
   allocated by a 16-token prompt and given the context's length (a step's cost does not
   depend on the state's values); the Transformer's KV cache is filled with random keys.

Usage::

    PYTHONPATH=src python benchmarks/linear_recurrences.py                 # both parts
    PYTHONPATH=src python benchmarks/linear_recurrences.py --update-docs   # also docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line, write_section
from attnlab.cache.base import KVCache
from attnlab.functional.delta_rule import delta_rule_chunked, delta_rule_reference
from attnlab.functional.gla import gla_chunked, gla_reference
from attnlab.functional.rglru import linear_recurrence_reference, linear_recurrence_scan
from attnlab.functional.rwkv7 import rwkv7_chunked, rwkv7_reference
from attnlab.functional.short_conv import short_conv, short_conv_reference
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.layout import LayerSpec
from attnlab.models.linear_layout import LinearLayerConfig
from ssm import VOCAB, _cache_bytes, _fwd_bwd, _kv_cache_at, _ms, table_models, time_interleaved

HEADING = "## Linear attention and gated recurrences (issue 27)"
NEW_MIXERS = {
    "DeltaNet": "delta_net",
    "Gated DeltaNet": "gated_delta_net",
    "GLA": "gla",
    "RG-LRU (Griffin block)": "rglru",
    "Gated short conv (LFM2)": "short_conv",
    "RWKV-7 (time mix)": "rwkv7",
}


def part_forms(rounds: int, length: int, channels: int) -> list[str]:
    g = torch.Generator().manual_seed(0)
    b, h, dk, dv = 1, 4, 64, 64
    q = torch.randn(b, h, length, dk, generator=g)
    k = F.normalize(torch.randn(b, h, length, dk, generator=g), dim=-1)
    v = torch.randn(b, h, length, dv, generator=g)
    beta = torch.rand(b, h, length, generator=g)
    gate = -torch.rand(b, h, length, generator=g) * 0.1
    gk = F.logsigmoid(torch.randn(b, h, length, dk, generator=g)) / 16
    a = torch.rand(b, length, channels, generator=g) ** 0.1
    u = torch.randn(b, length, channels, generator=g)
    w = torch.randn(channels, 3, generator=g)
    fns: dict[str, Callable[[], None]] = {
        "delta step": _fwd_bwd(delta_rule_reference, [q, k, v, beta]),
        "delta chunked": _fwd_bwd(delta_rule_chunked, [q, k, v, beta]),
        "gdn step": _fwd_bwd(
            lambda *x: delta_rule_reference(*x[:4], g=x[4]), [q, k, v, beta, gate]
        ),
        "gdn chunked": _fwd_bwd(
            lambda *x: delta_rule_chunked(*x[:4], g=x[4]), [q, k, v, beta, gate]
        ),
        "gla step": _fwd_bwd(gla_reference, [q, k, v, gk]),
        "gla chunked": _fwd_bwd(gla_chunked, [q, k, v, gk]),
        "lru step": _fwd_bwd(linear_recurrence_reference, [a, u]),
        "lru scan": _fwd_bwd(linear_recurrence_scan, [a, u]),
        "rwkv7 step": _fwd_bwd(rwkv7_reference, [q, k, v, -k, k * beta[..., None], gk]),
        "rwkv7 chunked": _fwd_bwd(rwkv7_chunked, [q, k, v, -k, k * beta[..., None], gk]),
        "conv step": _fwd_bwd(short_conv_reference, [u, w]),
        "conv parallel": _fwd_bwd(short_conv, [u, w]),
    }
    peers: list[tuple[str, str, str]] = []
    try:
        from transformers.models.qwen3_next import modeling_qwen3_next as qn

        def hf_gdn(q: Any, k: Any, v: Any, beta: Any, gate: Any) -> Any:
            t = (x.transpose(1, 2) for x in (q, k, v, gate, beta))
            qq, kk, vv, gg, bb = t
            return qn.torch_chunk_gated_delta_rule(qq, kk, vv, g=gg, beta=bb)

        fns["gdn transformers"] = _fwd_bwd(hf_gdn, [q, k, v, beta, gate])
        peers.append(("Gated delta rule", "gdn transformers", "gdn chunked"))
        from transformers.models.recurrent_gemma import modeling_recurrent_gemma as rg

        reset = torch.zeros(b, length, 1, dtype=torch.bool)

        def hf_scan(a: Any, u: Any) -> Any:
            return rg.RecurrentGemmaRglru._rnn_scan(None, u, a, reset, None)  # type: ignore[arg-type]

        fns["lru transformers"] = _fwd_bwd(hf_scan, [a, u])
        peers.append(("RG-LRU recurrence", "lru transformers", "lru scan"))
    except ImportError:
        pass
    t = {name: _ms(x) for name, x in time_interleaved(fns, rounds=rounds, warmup=1).items()}
    rows = [
        ("DeltaNet delta rule, H = 4, K = V = 64, chunk 64", "delta step", "delta chunked"),
        ("Gated delta rule, H = 4, K = V = 64, chunk 64", "gdn step", "gdn chunked"),
        ("GLA, H = 4, K = V = 64, chunk 64 (sub-chunks of 16)", "gla step", "gla chunked"),
        (
            "RWKV-7 generalized delta rule, H = 4, K = V = 64, chunk 64",
            "rwkv7 step",
            "rwkv7 chunked",
        ),
        (f"RG-LRU recurrence, D = {channels}, chunk 64", "lru step", "lru scan"),
        (f"short convolution, D = {channels}, K = 3", "conv step", "conv parallel"),
    ]
    lines = [
        f"| layer (L = {length}, fwd + bwd) | step-by-step ms | chunked / parallel ms | ratio (target >= 10x) |",
        "|---|---|---|---|",
    ]
    for label, slow, fast in rows:
        lines.append(f"| {label} | {t[slow]:.0f} | {t[fast]:.0f} | **{t[slow] / t[fast]:.1f}x** |")
    if peers:
        lines += [
            "",
            f"| against transformers (L = {length}, fwd + bwd) | transformers ms | attnlab ms | attnlab speed-up (target >= 1.0x) |",
            "|---|---|---|---|",
        ]
        names = {
            "gdn transformers": "`torch_chunk_gated_delta_rule` (Qwen3-Next)",
            "lru transformers": "`RecurrentGemmaRglru._rnn_scan`",
        }
        for label, theirs, ours in peers:
            lines.append(
                f"| {label}: {names[theirs]} vs `{ours.split()[0]}` | {t[theirs]:.0f} | "
                f"{t[ours]:.0f} | **{t[theirs] / t[ours]:.2f}x** |"
            )
    return lines


def new_models() -> dict[str, torch.nn.Module]:
    """One ~10 M-parameter pure model per new mixer (width 256, 4 heads of 64)."""
    out: dict[str, torch.nn.Module] = {}
    for label, mixer in NEW_MIXERS.items():
        torch.manual_seed(0)
        spec = LayerSpec(
            mixer=mixer, linear=LinearLayerConfig(conv_kernel=3 if mixer == "short_conv" else 4)
        )
        layers = {
            "delta_net": 7,
            "gated_delta_net": 7,
            "gla": 8,
            "rglru": 7,
            "short_conv": 9,
            "rwkv7": 6,
        }[mixer]
        cfg = DecoderConfig(
            vocab_size=VOCAB,
            hidden_size=256,
            num_hidden_layers=layers,
            num_attention_heads=4,
            intermediate_size=688,
            position_embedding="none",
            layers=(spec,) * layers,
        )
        out[label] = DecoderLM(cfg)
    return out


def _is_attention(model: torch.nn.Module) -> bool:
    return isinstance(model, DecoderLM) and any(
        s.mixer == "attention" for s in model.config.layer_specs
    )


def part_table(contexts: list[int], train_length: int, steps: int) -> list[str]:
    models = {k: m.eval() for k, m in {**table_models(), **new_models()}.items()}
    params = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
    tok = torch.zeros(1, 1, dtype=torch.long)
    caches: dict[str, dict[int, Any]] = {k: {} for k in models}
    memory: dict[str, dict[int, int]] = {k: {} for k in models}
    with torch.no_grad():
        for k, m in models.items():
            if _is_attention(m):
                for ctx in contexts:
                    caches[k][ctx] = _kv_cache_at(m, ctx)  # type: ignore[arg-type]
            else:
                base = m.new_cache()  # type: ignore[operator]
                m(torch.randint(0, VOCAB, (1, 16)), past_key_values=base)
                for ctx in contexts:
                    c = copy.deepcopy(base)
                    for layer in c.layers:
                        assert not isinstance(layer, KVCache)
                        layer.length = ctx
                    caches[k][ctx] = c
            for ctx in contexts:
                memory[k][ctx] = _cache_bytes(caches[k][ctx])

        def stepper(k: str, ctx: int) -> Callable[[], None]:
            def run() -> None:
                models[k](tok, past_key_values=caches[k][ctx], logits_to_keep=1)

            return run

        t = time_interleaved(
            {f"{k}@{c}": stepper(k, c) for c in contexts for k in models}, rounds=steps, warmup=2
        )
    decode = {k: {c: _ms(t[f"{k}@{c}"]) for c in contexts} for k in models}
    ids = torch.randint(0, VOCAB, (1, train_length))

    def trainer(k: str) -> Callable[[], None]:
        def run() -> None:
            models[k].train()
            models[k](ids).logits.float().logsumexp(-1).mean().backward()
            models[k].zero_grad(set_to_none=True)

        return run

    tr = time_interleaved({k: trainer(k) for k in models}, rounds=2, warmup=1)
    train = {k: _ms(tr[k]) for k in models}
    recurrent = [k for k in models if not _is_attention(models[k])]
    fastest = min(train[k] for k in recurrent)
    lo, hi = contexts[0], contexts[-1]
    lines = [
        f"| model | params | decode ms/token at {lo} | at {hi} | {hi} / {lo} (target <= 1.2x) | "
        f"state/cache at {lo} | at {hi} | train step {train_length} ms | / fastest recurrent (target <= 2x) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k in models:
        ratio = "" if k not in recurrent else f"{train[k] / fastest:.2f}x"
        lines.append(
            f"| {k} | {params[k] / 1e6:.2f} M | {decode[k][lo]:.2f} | {decode[k][hi]:.2f} | "
            f"{decode[k][hi] / decode[k][lo]:.2f}x | {memory[k][lo] / 2**20:.3f} MiB | "
            f"{memory[k][hi] / 2**20:.3f} MiB | {train[k]:.0f} | {ratio} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="+", default=["forms", "table"], choices=["forms", "table"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--channels", type=int, default=256)
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 4096])
    p.add_argument("--train-length", type=int, default=2048)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--update-docs", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    flags = " ".join(
        a for a in (argv if argv is not None else sys.argv[1:]) if a != "--update-docs"
    )
    stamp = (
        f"Measured by `PYTHONPATH=src python benchmarks/linear_recurrences.py {flags}` "
        f"({machine_line()}; process time, median of interleaved rounds; load average "
        f"{os.getloadavg()[0]:.0f} on the shared machine when the run began)."
    )
    body = [stamp, ""]
    if "forms" in args.parts:
        lines = part_forms(args.rounds, args.length, args.channels)
        print("\n".join(lines), flush=True)
        body += ["### Chunked forms against the recurrences and transformers", "", *lines, ""]
    if "table" in args.parts:
        lines = part_table(args.contexts, args.train_length, args.decode_steps)
        print("\n".join(lines), flush=True)
        body += [
            "### Decoding and training beside attention, Mamba, RWKV-4, RetNet",
            "",
            *lines,
            "",
        ]
    print(f"({time.time() - t0:.0f} s; {machine_line()})")
    if args.update_docs:
        write_section(HEADING, "\n".join(body))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
