"""``attnlab visualize``: the attention of a real model on a text, as pictures and an explorer."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "visualize",
        help="write attention heatmaps, head statistics and the HTML explorer for a text",
        description=(
            "Run a model (default: all-MiniLM-L6-v2) on a text and write, in one folder that opens "
            "with index.html: a self-contained HTML attention explorer (pick a layer and head, hover "
            "a token, compare heads side by side; no CDN, works from file://), a grid of every head "
            "per layer, an annotated heatmap of the last layer, and maps of entropy, attention "
            "distance and first-token share per head and layer."
        ),
        epilog="example:\n  attnlab visualize --text 'the cat sat on the mat' --out attention/",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        help="a local Hugging Face model folder or a .gguf file (default all-MiniLM-L6-v2)",
    )
    p.add_argument("--text", default="time flies like an arrow", help="the text to look at")
    p.add_argument("--out", default="attnlab-attention", help="output folder")
    p.add_argument("--json", action="store_true", help="print the written files as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from attnlab.cli._common import Progress, load_model, print_json, writable_dir
    from attnlab.viz.report import write_attention_pictures, write_index

    text = args.text.strip()
    if not text:
        raise ValueError("--text is empty")
    writable_dir("--out", args.out)
    progress = Progress(4, quiet=args.json)
    progress.step("loading the model and tokenizer")
    model, tokenizer, name = load_model(args.model)
    batch = tokenizer(text, return_tensors="pt")
    n = batch["input_ids"].shape[1]
    from attnlab.viz.explorer import MAX_TOKENS

    if n > MAX_TOKENS:
        raise ValueError(f"--text has {n} tokens; the explorer shows at most {MAX_TOKENS}")
    tokens = tokenizer.convert_ids_to_tokens(batch["input_ids"][0].tolist())
    progress.step(f"running {name} on {n} tokens")
    if getattr(model, "is_encoder_decoder", False):
        with torch.no_grad():
            start = torch.full((1, 1), model.config.decoder_start_token_id)
            out = model(**batch, decoder_input_ids=start, output_attentions=True)
        attentions = out.encoder_attentions  # the encoder's self-attention over the text
    else:
        with torch.no_grad():
            out = model(**batch, output_attentions=True)
        attentions = out.attentions
    if not attentions:
        raise ValueError(f"{name} returned no attention weights to draw")
    progress.step("drawing")
    layers = list(attentions)

    def tick(layer: int) -> None:
        progress.tick(layer + 1, len(layers), "layers drawn")

    entries = write_attention_pictures(
        args.out, layers, tokens, name=name, subtitle=text, on_layer=tick
    )
    index = write_index(args.out, f"{name}: attention on {text!r}", entries)
    progress.step("done")
    files = [str(index)] + [str(Path(args.out) / e.file) for e in entries]
    if args.json:
        print_json({"index": str(index), "files": files})
    else:
        print(f"{len(files)} files in {args.out}; open {index}")
        for f in files:
            print(f"  {f}")
    return 0
