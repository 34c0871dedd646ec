"""``attnlab finetune``: LoRA / QLoRA supervised fine-tuning of a pretrained model on chat data."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from attnlab.cli._common import (
    int_at_least,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
    seed_int,
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "finetune",
        help="fine-tune a pretrained model on chat JSONL with LoRA or QLoRA",
        description=(
            "LoRA (Hu et al., 2021) or QLoRA (Dettmers et al., 2023: the frozen base in NF4) "
            "on a transformers folder or a .gguf file. Rows are {'messages': [...]} or "
            "{'prompt', 'completion'}; the chat template renders them and the loss counts the "
            "assistant's tokens. Batches are packed (the document pattern: no attention or "
            "position leak between examples) or length-grouped and padded, whichever the cost "
            "model finds cheaper. Writes metrics.jsonl, loss_curve.png, checkpoints/, a peft "
            "adapter (adapter/) and the merged transformers model (merged/)."
        ),
        epilog=(
            "examples:\n"
            "  attnlab finetune MODEL_DIR chat.jsonl --lora-rank 16 --steps 200 --out runs/sft\n"
            "  attnlab finetune model.gguf chat.jsonl --qlora --max-len 256 --json\n"
            "  attnlab finetune MODEL_DIR chat.jsonl --out runs/sft --resume latest"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="a transformers model folder or a .gguf file")
    p.add_argument("data", help="chat rows, one JSON object per line")
    p.add_argument("--eval-data", help="held-out rows (default: --heldout-percent of DATA)")
    p.add_argument(
        "--heldout-percent",
        type=int_at_least(1),
        default=10,
        help="share of DATA held out when --eval-data is not given (default 10)",
    )
    p.add_argument("--lora-rank", type=positive_int, default=16, help="LoRA rank r (default 16)")
    p.add_argument(
        "--lora-alpha", type=positive_float, default=32.0, help="LoRA scale alpha (default 32)"
    )
    p.add_argument(
        "--lora-dropout",
        type=nonnegative_float,
        default=0.05,
        help="dropout on the LoRA input (default 0.05)",
    )
    p.add_argument("--rslora", action="store_true", help="scale by alpha/sqrt(rank) (rsLoRA)")
    p.add_argument(
        "--targets",
        help=(
            "comma-separated module names, attnlab's or transformers', or all-linear "
            "(default: every attention and MLP projection)"
        ),
    )
    p.add_argument("--qlora", action="store_true", help="hold the frozen base in NF4 (QLoRA)")
    p.add_argument("--max-len", type=positive_int, default=512, help="tokens per packed row")
    p.add_argument(
        "--layout",
        choices=["auto", "packed", "padded"],
        default="auto",
        help="packed rows or length-grouped padded batches (default: the cost model chooses)",
    )
    p.add_argument("--steps", type=positive_int, default=100, help="optimizer steps (default 100)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="rows per optimizer step")
    p.add_argument(
        "--micro-batch-size",
        type=nonnegative_int,
        default=0,
        help="rows per forward, accumulated up to --batch-size (0 = all at once)",
    )
    p.add_argument("--lr", type=positive_float, default=2e-4, help="AdamW learning rate (2e-4)")
    p.add_argument(
        "--warmup-steps", type=nonnegative_int, default=10, help="linear warm-up steps (10)"
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="compute dtype (bfloat16: autocast; default float32)",
    )
    p.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute each layer in the backward (less memory, more time)",
    )
    p.add_argument(
        "--eval-every",
        type=nonnegative_int,
        default=0,
        help="held-out loss every N steps (0 = before and after only)",
    )
    p.add_argument(
        "--save-every",
        type=nonnegative_int,
        default=0,
        help="checkpoint every N steps (0 = at the end only)",
    )
    p.add_argument("--seed", type=seed_int, default=0, help="seed of data order and LoRA init")
    p.add_argument("--out", default="runs/finetune", help="output folder")
    p.add_argument("--resume", metavar="CHECKPOINT", help="a checkpoint folder, or 'latest'")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def run(args: argparse.Namespace) -> int:
    from attnlab.train.finetune import FinetuneConfig, finetune

    config = FinetuneConfig(
        model=args.model,
        data=args.data,
        out_dir=args.out,
        eval_data=args.eval_data,
        heldout_percent=args.heldout_percent,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        rslora=args.rslora,
        **({"targets": args.targets} if args.targets else {}),
        qlora=args.qlora,
        max_len=args.max_len,
        layout=args.layout,
        steps=args.steps,
        batch_size=args.batch_size,
        micro_batch_size=args.micro_batch_size,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        dtype=args.dtype,
        gradient_checkpointing=args.gradient_checkpointing,
        eval_every=args.eval_every,
        save_every=args.save_every,
        seed=args.seed,
        progress=not (args.no_progress or args.json),
    )
    s = finetune(config, resume=args.resume)
    if args.json:
        from attnlab.cli._common import print_json

        print_json(s)
    else:
        before, after = s["heldout_loss_before"], s["heldout_loss_after"]
        print(f"layout {s['layout_reason']}")
        print(
            f"trainable {s['trainable_params']:,} of {s['total_params']:,} parameters "
            f"({s['trainable_params'] / s['total_params']:.2%}); peak memory "
            f"{_gib(s['peak_rss_bytes'])}; {s['tokens_per_s']:.0f} tokens/s; "
            + (f"held-out loss {before:.4f} -> " if before is not None else "held-out loss ")
            + f"{after:.4f}"
        )
        print(
            f"wrote {args.out} (metrics.jsonl, loss_curve.png, checkpoints/, "
            + ", ".join(f"{k}: {v}" for k, v in s["exports"].items())
            + ")"
        )
    sys.stdout.flush()
    return 0
