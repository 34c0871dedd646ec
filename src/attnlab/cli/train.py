"""``attnlab train``: train a model from a TOML/JSON config or a preset.

Under ``torchrun`` the same command trains on several processes (see docs/training.md).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from attnlab.cli._common import print_json


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "train",
        help="train a model (decoder, encoder, seq2seq) from a config file or a preset",
        description=(
            "Train an attnlab model: AdamW with warmup + cosine, clipping, accumulation, "
            "bfloat16 autocast, torch.compile, held-out evaluation, metrics.jsonl, "
            "loss_curve.png, checkpoints that resume exactly, and a model folder that "
            "`attnlab generate --model` loads. Run it under torchrun for DDP or FSDP2."
        ),
        epilog=(
            "examples:\n"
            "  attnlab train --preset stdlib-bytes\n"
            "  attnlab train run.toml --set optim.lr=3e-4 --set steps=500\n"
            "  attnlab train --preset copy --set steps=50 --out runs/copy\n"
            "  attnlab train run.toml --resume latest\n"
            "  torchrun --nproc-per-node 2 -m attnlab.cli.main train run.toml "
            "--set parallel.strategy=fsdp"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", help="a .toml or .json training config")
    p.add_argument("--preset", help="start from a named preset (see --list-presets)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, dotted for sections (optim.lr=3e-4); repeatable",
    )
    p.add_argument("--out", help="output folder (same as --set out_dir=...)")
    p.add_argument(
        "--resume", metavar="CHECKPOINT", help="continue from a checkpoint folder, or 'latest'"
    )
    p.add_argument(
        "--until",
        type=int,
        metavar="STEP",
        help="stop after this step and save (same schedule: --resume continues exactly)",
    )
    p.add_argument(
        "--list-presets", action="store_true", help="print the presets with what each trains"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the result (steps, losses, held-out metrics, tokens/s, out_dir) as JSON",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from attnlab.train.config import TrainConfig, apply_overrides, load_config
    from attnlab.train.presets import DESCRIPTIONS, PRESETS, preset

    if args.list_presets:
        if args.json:
            print_json({name: DESCRIPTIONS.get(name, "") for name in sorted(PRESETS)})
            return 0
        width = max(map(len, PRESETS))
        for name in sorted(PRESETS):
            print(f"{name:<{width}}  {DESCRIPTIONS.get(name, '')}".rstrip())
        return 0
    if args.config and args.preset:
        raise ValueError("pass a config file or --preset, not both (use --set to change a preset)")
    overrides = list(args.overrides) + ([f'out_dir="{args.out}"'] if args.out else [])
    if args.preset:
        config = TrainConfig.from_dict(apply_overrides(preset(args.preset), overrides))
    elif args.config:
        config = load_config(args.config, overrides)
    else:
        raise ValueError("pass a training config file (TOML or JSON) or --preset NAME")
    from attnlab.train.trainer import Trainer

    with Trainer(config) as trainer:
        result = trainer.train(resume=args.resume, until=args.until)
        if trainer.ctx.is_main and args.json:
            print_json(
                {
                    "steps": result.steps,
                    "train_loss": result.train_loss,
                    "eval": result.eval,
                    "tokens_per_s": result.tokens_per_s,
                    "out_dir": str(result.out_dir),
                }
            )
        elif trainer.ctx.is_main:
            parts = [f"steps {result.steps}", f"train loss {result.train_loss:.4f}"]
            parts += [
                f"held-out {k.removeprefix('eval_').replace('_', ' ')} {v:.4f}"
                for k, v in result.eval.items()
            ]
            parts.append(f"{result.tokens_per_s:.0f} tokens/s")
            print("; ".join(parts))
            print(f"wrote {result.out_dir} (metrics.jsonl, loss_curve.png, checkpoints/, model/)")
    sys.stdout.flush()
    return 0
