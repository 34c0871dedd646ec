"""``attnlab diagnose``: run a model once with hooks and report what is wrong, with fixes."""

from __future__ import annotations

import argparse
from typing import Any

from attnlab.cli._common import ReportedFailure, print_json

FAULTS = ("nan-weights", "blank-mask", "float-mask", "overflow", "collapsed-router")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "diagnose",
        help="find the first module producing NaN/Inf, mask and shape mistakes, odd attention heads",
        description=(
            "Run a model (default: all-MiniLM-L6-v2) on a text with forward hooks. The report "
            "names the first module whose output holds NaN or Inf (as in model.named_modules()) "
            "with the statistics of its inputs, checks the inputs' shapes and masks and spells "
            "out the fix, and lists per layer (and, with --heads, per head) the attention "
            "statistics: row-sum error, entropy, largest weight, share on the first token "
            "(attention sinks) and fully masked rows; for MoE models, the expert load per layer "
            "(tokens per expert, dropped share, router entropy) with collapsed routers flagged. "
            "--inject plants a known fault to see what the report says about it."
        ),
        epilog="example:\n  attnlab diagnose --text 'time flies like an arrow' --inject nan-weights",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", help="a local Hugging Face model folder (default all-MiniLM-L6-v2)")
    p.add_argument(
        "--text",
        action="append",
        help="a text to run (repeat for a padded batch); default 'time flies like an arrow'",
    )
    p.add_argument(
        "--inject",
        choices=FAULTS,
        help="plant a fault: NaN in layer 1's feed-forward weights, a mask blanking the last "
        "sequence, an additive float mask as attention_mask, float16 overflow, a collapsed "
        "router in the last MoE layer (an MoE --model: Mixtral, Qwen2-MoE, OLMoE)",
    )
    p.add_argument("--heads", action="store_true", help="print every head, not only layers")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from attnlab.analysis.diagnostics import diagnose
    from attnlab.cli._common import Progress, load_model

    progress = Progress(3, quiet=args.json)
    progress.step("loading the model and tokenizer")
    model, tokenizer, name = load_model(args.model)
    texts = args.text or ["time flies like an arrow"]
    if any(not t.strip() for t in texts):
        raise ValueError("--text is empty")
    batch = dict(tokenizer(texts, return_tensors="pt", padding=True))
    if args.inject == "collapsed-router":
        from attnlab.modules.moe import MoEBlock

        blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
        if not blocks:
            raise ValueError(
                f"--inject collapsed-router needs a model with MoE layers; {name} has none "
                "(pass --model with a Mixtral, Qwen2-MoE or OLMoE folder)"
            )
        with torch.no_grad():  # equal logits for every expert: every token picks the same ones
            blocks[-1].router.weight.zero_()
    elif args.inject == "nan-weights":
        layer = model.layers[min(1, len(model.layers) - 1)]
        with torch.no_grad():
            layer.feed_forward.fc_in.weight[0, 0] = float("nan")
    elif args.inject == "blank-mask":
        batch["attention_mask"][-1] = 0
    elif args.inject == "float-mask":
        am = batch["attention_mask"]
        batch["attention_mask"] = torch.zeros(am.shape).masked_fill(am == 0, float("-inf"))
    elif args.inject == "overflow":
        model = model.half()
        with torch.no_grad():
            w = model.layers[0].feed_forward.fc_in.weight
            w.copy_(torch.randn(w.shape) * 1e4)
    progress.step(f"running {name} with hooks on {len(texts)} text(s)")
    report = diagnose(model, batch)
    progress.step("done")
    if args.json:
        print_json(report.to_dict())
        return _status(report)
    print(f"model: {name}; backend: {report.backend}")
    print(report.summary())
    if report.first_nonfinite_module:
        print(f"\nfirst non-finite module: {report.first_nonfinite_module}")
        for i, s in enumerate(report.first_nonfinite_inputs):
            print(f"  input {i}: {s}")
    if args.heads and report.heads:
        print("\nlayer head  row-sum err  entropy  max weight  first-token  masked rows  distance")
        for h in report.heads:
            print(
                f"{h.layer:>5} {h.head:>4}  {h.row_sum_error:11.2e}  {h.entropy:7.3f}  "
                f"{h.max_weight:10.3f}  {h.first_token_share:11.3f}  {h.fully_masked_rows:>11}  "
                f"{h.mean_distance:8.2f}"
            )
    return _status(report)


def _status(report: Any) -> int:
    if report.ok:
        return 0
    first = report.first_nonfinite_module
    where = f"; first non-finite module: {first}" if first else ""
    raise ReportedFailure(f"the diagnosis found {len(report.issues)} issue(s){where}")
