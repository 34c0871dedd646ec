"""``attnlab experiment NAME``: rerun a published result on this machine."""

from __future__ import annotations

import argparse
import json
from typing import Any

from attnlab.cli._common import positive_int, seed_int
from attnlab.experiments import EXPERIMENTS


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "experiment",
        help="reproduce a paper's result with small models (extrapolation, recall, ...)",
        description=(
            "Train small models with attnlab's trainer and compare with a published result. "
            "Writes results.md, results.json and plot.png under --out. Full runs take up to "
            "30 minutes on two CPU cores, --quick about two."
        ),
        epilog="experiments:\n  "
        + "\n  ".join(sorted(EXPERIMENTS))
        + "\nexample:\n  attnlab experiment extrapolation --quick --out runs/extrapolation",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", choices=sorted(EXPERIMENTS), metavar="NAME", help="the experiment")
    p.add_argument("--quick", action="store_true", help="the short run (~2 minutes)")
    p.add_argument("--out", help="output folder (default runs/NAME)")
    p.add_argument("--seed", type=seed_int, default=0, help="first seed of data and weights (0)")
    p.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        help="CPU threads for torch (1: the models are tiny, and on a shared machine two "
        "threads ran a step 30x slower than one)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from attnlab.experiments import run_experiment

    out = Path(args.out) if args.out else Path("runs") / args.name
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"--out {str(out)!r} is not a writable folder: {e.strerror}") from None
    torch.set_num_threads(args.threads)
    r = run_experiment(args.name, quick=args.quick, out=out, seed=args.seed, progress=not args.json)
    if args.json:
        print(json.dumps(r.to_dict(), indent=2, allow_nan=False))
    else:
        print(r.markdown())
        print(f"written to {out}/ (results.md, results.json, plot.png)")
    return 0
