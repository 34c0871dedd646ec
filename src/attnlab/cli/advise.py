"""``attnlab advise``: attention settings for a task, a length and a memory budget, with reasons."""

from __future__ import annotations

import argparse
from typing import Any

from attnlab._validate import check_real
from attnlab.cli._common import (
    ReportedFailure,
    _number_type,
    positive_float,
    positive_int,
    print_json,
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "advise",
        help="recommend attention variant, backend, positions, KV heads, window, dtype, checkpointing",
        description=(
            "Recommend how to set up attention for a task. Every recommendation comes with its "
            "reason in numbers from attnlab's cost model (memory and FLOPs at your length) and "
            "from backend speeds measured on a 2-core CPU. The tutorial's selection guide is the "
            "starting point; where the numbers disagree with it, the numbers win and the reason "
            "says so. Encoder tasks are costed for training (fine-tuning), generation tasks for "
            "inference, with latency per generated token."
        ),
        epilog=(
            "examples:\n  attnlab advise --task long-document --seq-len 8192 --memory-gb 4\n"
            "  attnlab advise --task realtime --seq-len 4096 --memory-gb 4 --latency-ms 50\n"
            "  attnlab advise --params 20M --seq-len 1024 --memory-gb 8      (size a model)\n"
            "  attnlab advise --hours 10 --seq-len 512 --memory-gb 4 --extrapolation 4"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--task",
        choices=["classification", "long-document", "generation", "realtime"],
        help="what the model is for",
    )
    p.add_argument("--seq-len", type=positive_int, required=True, help="tokens per sequence")
    p.add_argument("--memory-gb", type=positive_float, required=True, help="memory budget in GiB")
    p.add_argument(
        "--latency-ms", type=positive_float, help="latency budget (per forward / per token)"
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where it runs")
    p.add_argument(
        "--batch-size", type=positive_int, default=1, help="sequences at once (default 1)"
    )
    p.add_argument("--mode", choices=["training", "inference"], help="override what is costed")
    p.add_argument("--preset", help="start from this architecture (see attnlab estimate --help)")
    p.add_argument(
        "--config",
        help="start from this config JSON (attnlab's, or a Hugging Face config.json / folder)",
    )
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    size = p.add_argument_group(
        "sizing (recommend layers, width, heads from a budget; give one of --params, "
        "--compute, --hours instead of --task)"
    )
    size.add_argument("--params", type=_amount, help="parameter budget (e.g. 20M, 1.3B)")
    size.add_argument(
        "--compute", type=_amount, help="training compute budget in FLOPs (e.g. 1e18)"
    )
    size.add_argument("--hours", type=_amount, help="training time budget on this machine")
    size.add_argument("--tokens", type=_amount, help="training tokens available (e.g. 500M)")
    size.add_argument(
        "--vocab-size", type=positive_int, default=32000, help="vocabulary (default 32000)"
    )
    size.add_argument(
        "--extrapolation",
        type=positive_float,
        default=1.0,
        help="inputs reach this many times the training length (chooses the positions)",
    )
    size.add_argument("--gflops", type=_amount, help="measured matmul GFLOP/s of the machine")
    p.set_defaults(func=run)


_SUFFIX = {"K": 1e3, "M": 1e6, "G": 1e9, "B": 1e9, "T": 1e12}


def _suffixed(text: str) -> float:
    """``"20M"`` -> 2e7, ``"1e18"`` -> 1e18 (``ValueError`` when it is no number)."""
    t = text.strip()
    mult = _SUFFIX.get(t[-1:].upper(), 1.0) if t else 1.0
    return float(t[:-1] if mult != 1.0 else t) * mult


_amount = _number_type(
    "a positive number such as 20M, 1.3B or 1e18",
    _suffixed,
    lambda v: check_real("value", v, gt=0.0),
)


def run_sizing(args: argparse.Namespace) -> int:
    from attnlab.analysis.sizing import size_model

    advice = size_model(
        context=args.seq_len,
        memory_gb=args.memory_gb,
        params=args.params,
        compute_flops=args.compute,
        hours=args.hours,
        tokens=args.tokens,
        vocab_size=args.vocab_size,
        batch_size=args.batch_size,
        extrapolation=args.extrapolation,
        throughput_gflops=args.gflops,
    )
    if args.json:
        print_json(advice.to_dict())
    else:
        print(advice.summary())
    return _status(advice.fits)


def _status(fits: bool) -> int:
    if not fits:
        raise ReportedFailure("no setting fits the budget (the report says what is closest)")
    return 0


def run(args: argparse.Namespace) -> int:
    from attnlab.analysis.advisor import advise

    sizing = [n for n in ("params", "compute", "hours") if getattr(args, n) is not None]
    if sizing:
        if args.task is not None:
            raise ValueError(f"pass --task or a sizing budget (--{sizing[0]}), not both")
        return run_sizing(args)
    if args.task is None:
        raise ValueError("pass --task (advice for a use) or one of --params/--compute/--hours")
    from attnlab.analysis.arch import preset
    from attnlab.cli.estimate import config_from_file

    if args.preset and args.config:
        raise ValueError("pass --preset or --config, not both")
    base = preset(args.preset) if args.preset else None
    if args.config:
        base = config_from_file(args.config)

    advice = advise(
        args.task,
        seq_len=args.seq_len,
        memory_gb=args.memory_gb,
        latency_ms=args.latency_ms,
        device=args.device,
        batch_size=args.batch_size,
        base=base,
        mode=args.mode,
    )
    if args.json:
        print_json(advice.to_dict())
    else:
        print(advice.summary())
    return _status(advice.fits)
