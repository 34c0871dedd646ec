"""``attnlab estimate``: FLOPs and memory by arithmetic, from a preset or a config file.

Runs no model and imports no torch for a preset: it answers in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from attnlab.cli._common import int_at_least, positive_int, print_json, writable_file


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "estimate",
        help="FLOPs, parameter, activation and KV-cache memory of a model, without running it",
        description=(
            "Estimate a model's cost with attnlab's cost model (attnlab.analysis.estimate). "
            "Without --seq-len it prints the tutorial's table (sequence 128 ... 2048, hidden 768, "
            "12 heads) extended to 32768 tokens for dense, sliding-window and GQA variants of the "
            "chosen architecture; with --seq-len it prints one report broken down by component. "
            "The model is given as a preset (--preset) or a config JSON file (--config)."
        ),
        epilog="examples:\n  attnlab estimate\n  attnlab estimate --preset llama-3-8b --seq-len 8192 "
        "--mode training --dtype bf16 --checkpointing\n  attnlab estimate --plot cost.png",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--preset",
        default="tutorial",
        help="architecture: tutorial (BERT-base sizes), bert-base, minilm, gpt2, llama-2-7b, "
        "llama-3-8b, mistral-7b (default: tutorial)",
    )
    p.add_argument(
        "--config",
        help="instead of --preset: a config JSON (attnlab's EncoderConfig, DecoderConfig or "
        "Seq2SeqConfig fields, or a Hugging Face config.json / model folder)",
    )
    p.add_argument("--seq-len", type=positive_int, help="one sequence length: print a full report")
    p.add_argument("--batch-size", type=positive_int, default=1, help="sequences (default 1)")
    p.add_argument(
        "--mode",
        choices=["inference", "training", "decode"],
        default="inference",
        help="one forward; forward + backward + optimizer; or one cached decoding step",
    )
    p.add_argument("--dtype", default="float32", help="float32, bf16, fp16 (default float32)")
    p.add_argument(
        "--backend",
        default="auto",
        help="attention backend costed: reference (builds the score matrix), sdpa, tiled, "
        "sparse, flex, linear (default auto)",
    )
    p.add_argument("--window", type=positive_int, help="causal sliding window of W keys")
    p.add_argument(
        "--kv-dtype",
        choices=["float", "int8", "int4", "int2"],
        default="float",
        help="decode: the KV cache stored in int8/int4/int2 (KIVI: keys per channel, values "
        "per token, the newest 32 tokens in float); float: --dtype (default)",
    )
    p.add_argument("--checkpointing", action="store_true", help="per-layer gradient checkpointing")
    p.add_argument(
        "--max-len",
        type=int_at_least(128),
        default=32768,
        help="table: longest sequence (default 32768)",
    )
    p.add_argument("--plot", metavar="PNG", help="table: also draw cost against sequence length")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(func=run)


def _spec(args: argparse.Namespace) -> Any:
    from attnlab.analysis.arch import describe, preset

    if args.config:
        from attnlab.analysis.cost_recurrent import is_recurrent

        config = config_from_file(args.config)
        return config if is_recurrent(config) else describe(config)
    return preset(args.preset)


def config_from_file(path: str) -> Any:
    """An attnlab config from a JSON file: attnlab's own fields (encoder, decoder or
    encoder-decoder), or a Hugging Face ``config.json`` (a model folder works too).

    Raises:
        ValueError: a file that none of them reads (the message says what each said).
    """
    from pathlib import Path

    from attnlab.models.config import EncoderConfig
    from attnlab.models.decoder_config import DecoderConfig
    from attnlab.models.recurrent_config import MambaConfig, RetNetConfig, RWKVConfig
    from attnlab.models.seq2seq_config import Seq2SeqConfig

    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read a JSON config from {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds {type(data).__name__}, not a JSON object")
    errors = []
    if "model_type" in data:  # a transformers config
        from attnlab.interop.hf import _converter

        arch = (data.get("architectures") or [data["model_type"]])[0]
        try:
            return _converter(str(data["model_type"]), arch).config_from_hf(
                data, _weight_names(file.parent)
            )
        except (ValueError, KeyError, TypeError) as e:
            errors.append(f"transformers config: {e}")
    for cls in (EncoderConfig, DecoderConfig, Seq2SeqConfig, MambaConfig, RWKVConfig, RetNetConfig):
        try:
            return cls.from_dict(data)  # type: ignore[attr-defined]
        except (ValueError, TypeError) as e:
            errors.append(f"{cls.__name__}: {e}")
    raise ValueError(f"{path} is not a config attnlab reads: " + "; ".join(errors))


def _weight_names(folder: Any) -> set[str]:
    """Tensor names in the folder's safetensors files, read from their headers only."""
    names: set[str] = set()
    try:
        from safetensors import safe_open
    except ImportError:
        return names
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            names.update(st.keys())
    return names


def _b(n: float) -> str:
    from attnlab.analysis.cost import human_bytes

    return human_bytes(n)


def _f(n: float) -> str:
    from attnlab.analysis.cost import human_flops

    return human_flops(n)


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from attnlab.analysis.arch import ArchSpec
    from attnlab.analysis.cost import estimate
    from attnlab.analysis.scaling import SEQ_LENS, scaling_table, tutorial_variants

    if args.plot:  # before the work: an unwritable --plot fails at once
        writable_file("--plot", args.plot)
    spec = _spec(args)
    if not isinstance(spec, ArchSpec):  # a state-space / recurrent model
        return _run_recurrent(spec, args)
    if args.seq_len is not None:
        report = estimate(
            spec,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            mode=args.mode,
            dtype=args.dtype,
            backend=args.backend,
            window=args.window,
            checkpointing=args.checkpointing,
            kv_dtype=args.kv_dtype,
        )
        if args.json:
            print_json(report.to_dict())
        else:
            print(report.summary())
            if report.mode == "training":
                print("  activations by variant:")
                for k, v in report.activation_variants.items():
                    print(f"    {k:<27} {_b(v):>10}")
            for note in report.notes:
                print(f"  note: {note}")
        return 0
    if args.kv_dtype != "float":
        raise ValueError(
            f"--kv-dtype {args.kv_dtype} costs one decoding step: give --seq-len and --mode decode"
        )
    lens = [n for n in SEQ_LENS if n <= args.max_len]
    rows = scaling_table(
        tutorial_variants(spec, window=args.window or 512), lens, batch_size=args.batch_size
    )
    if args.json:
        print_json([asdict(r) for r in rows])
    else:
        print(
            f"{spec.name}: {spec.num_layers} layers, hidden {spec.hidden_size}, {spec.num_heads} heads "
            f"of dim {spec.head_dim}; batch {args.batch_size}; forward FLOPs on a tiled backend; "
            "KV cache in float16"
        )
        header = (
            f"{'seq_len':>7}  {'tutorial n²d':>15}  {'attn/layer':>12}  {'model fwd':>12}  "
            f"{'scores/layer':>12}  {'infer (mat)':>11}  {'infer (tiled)':>13}  "
            f"{'train (tiled)':>13}  {'train (ckpt)':>12}  {'KV cache':>10}"
        )
        for variant in dict.fromkeys(r.variant for r in rows):
            print(f"\n{variant}")
            print(header)
            for r in (r for r in rows if r.variant == variant):
                print(
                    f"{r.seq_len:>7}  {r.tutorial_n2d:>15,}  {_f(r.attention_flops_per_layer):>12}  "
                    f"{_f(r.forward_flops):>12}  {_b(r.score_matrix_bytes):>12}  "
                    f"{_b(r.inference_activations_materialised):>11}  "
                    f"{_b(r.inference_activations_tiled):>13}  {_b(r.training_activations_tiled):>13}  "
                    f"{_b(r.training_activations_tiled_checkpointed):>12}  {_b(r.kv_cache_bytes):>10}"
                )
        print(
            "\nattn/layer = QKᵀ + weights·V = 4·n²·d for full attention (4x the tutorial's n²·d "
            "multiply-adds: two products, 2 FLOPs each);\nthe sliding window's grows as n·w; GQA "
            "leaves attention FLOPs alone and divides the KV cache by the group size."
        )
    if args.plot:
        from attnlab.viz.heatmap import save_png
        from attnlab.viz.plots import cost_vs_length_figure

        path = save_png(cost_vs_length_figure(rows), args.plot)
        print(f"plot: {path}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _run_recurrent(config: Any, args: argparse.Namespace) -> int:
    """``estimate`` of a Mamba/Mamba-2/RWKV/RetNet config: one report, or a table over lengths."""
    from attnlab.analysis.cost_recurrent import estimate_recurrent
    from attnlab.analysis.scaling import SEQ_LENS

    if args.seq_len is not None:
        report = estimate_recurrent(
            config,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            mode=args.mode,
            dtype=args.dtype,
        )
        print(json.dumps(report.to_dict(), indent=2) if args.json else report.summary())
        return 0
    lens = [n for n in SEQ_LENS if n <= args.max_len]
    rows = []
    for n in lens:
        inf = estimate_recurrent(config, batch_size=args.batch_size, seq_len=n, dtype=args.dtype)
        train = estimate_recurrent(
            config, batch_size=args.batch_size, seq_len=n, mode="training", dtype=args.dtype
        )
        dec = estimate_recurrent(
            config, batch_size=args.batch_size, seq_len=n, mode="decode", dtype=args.dtype
        )
        rows.append((n, inf, train, dec))
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "seq_len": n,
                        "inference": i.to_dict(),
                        "training": t.to_dict(),
                        "decode": d.to_dict(),
                    }
                    for n, i, t, d in rows
                ],
                indent=2,
            )
        )
        return 0
    print(
        f"{rows[0][1].model}: batch {args.batch_size}, {args.dtype}; the state replaces the KV cache"
    )
    print(
        f"{'seq_len':>7}  {'model fwd':>12}  {'train acts':>12}  {'decode/token':>12}  {'state':>10}"
    )
    for n, i, t, d in rows:
        print(
            f"{n:>7}  {_f(i.flops):>12}  {_b(t.activation_bytes):>12}  {_f(d.flops):>12}  "
            f"{_b(d.state_bytes):>10}"
        )
    return 0
