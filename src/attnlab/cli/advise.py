"""``attnlab advise``: attention settings for a task, a length and a memory budget, with reasons."""

from __future__ import annotations

import argparse
from typing import Any

from attnlab.cli._common import positive_float, positive_int, print_json


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
            "  attnlab advise --task realtime --seq-len 4096 --memory-gb 4 --latency-ms 50"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--task",
        required=True,
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from attnlab.analysis.advisor import advise
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
    return 0 if advice.fits else 1
