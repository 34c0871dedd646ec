"""``attnlab visualize``: the attention of a real model on a text, as pictures and an explorer."""

from __future__ import annotations

import argparse
from typing import Any

from attnlab.cli._common import nonnegative_int, positive_int


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
    p.add_argument(
        "--long-text",
        type=positive_int,
        default=None,
        metavar="N",
        help="instead of --text: N tokens of Python's documentation (pydoc_data.topics) "
        "through a decoder (default SmolLM2-135M-Instruct), shown pooled with the first "
        "--sinks keys one column each (the attention sinks); at most 2048",
    )
    p.add_argument(
        "--sinks",
        type=nonnegative_int,
        default=4,
        help="with --long-text: first keys shown one column each (default 4)",
    )
    p.add_argument("--json", action="store_true", help="print the written files as JSON")
    p.set_defaults(func=run)


#: Longest --long-text: the weights of every layer are held at once (30 layers x 9 heads of
#: SmolLM2 at 2048 tokens: 4.5 GB of float32).
MAX_LONG_TOKENS = 2048


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from attnlab.cli._common import Progress, load_model, print_json, writable_dir
    from attnlab.viz.report import write_attention_pictures, write_index

    if args.long_text is not None:
        return _long_text(args)
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


def _long_text(args: argparse.Namespace) -> int:
    """``--long-text N``: a decoder's attention over N tokens of the docs, sink columns kept."""
    from pathlib import Path

    import torch

    from attnlab.cli._common import Progress, load_model, print_json, writable_dir
    from attnlab.experiments._real import doc_tokens, load_smollm2
    from attnlab.viz.long_text import long_text_html
    from attnlab.viz.report import IndexEntry, write_index
    from attnlab.viz.sinks import first_token_shares, sink_figure

    n = args.long_text
    if n < 2 or n > MAX_LONG_TOKENS:
        raise ValueError(f"--long-text must be in [2, {MAX_LONG_TOKENS}] tokens, got {n}")
    writable_dir("--out", args.out)
    progress = Progress(4, quiet=args.json)
    progress.step("loading the model and tokenizer")
    if args.model is None:
        model, name = load_smollm2(), "SmolLM2-135M-Instruct"
        tokenizer = model.tokenizer
    else:
        model, tokenizer, name = load_model(args.model)
    if getattr(model, "is_encoder_decoder", False) or not hasattr(model, "layer_windows"):
        raise ValueError(f"--long-text shows a decoder's causal attention; {name} is not one")
    ids = doc_tokens(tokenizer, n)
    tokens = tokenizer.convert_ids_to_tokens(ids[0].tolist())
    progress.step(f"running {name} on {n} tokens of Python's documentation")
    with torch.no_grad():
        attentions = list(model(ids, output_attentions=True).attentions)
    if not attentions:
        raise ValueError(f"{name} returned no attention weights to draw")
    progress.step("drawing")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    subtitle = (
        f"{n} tokens of pydoc_data.topics; keys 0-{args.sinks - 1} one column each, the rest "
        "summed in bins, queries averaged in bins"
        if args.sinks
        else f"{n} tokens of pydoc_data.topics, keys summed and queries averaged in bins"
    )
    page = long_text_html(
        attentions,
        tokens,
        sinks=args.sinks,
        title=f"{name}: attention over a long text",
        subtitle=subtitle,
    )
    tmp = out / "long_text.html.tmp"
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out / "long_text.html")
    fig = sink_figure(first_token_shares(attentions), title=f"{name}: share on the first token")
    fig.savefig(out / "sinks.png", dpi=110)
    entries = [
        IndexEntry("long_text.html", "the explorer over the whole text, sink columns kept"),
        IndexEntry("sinks.png", "share of attention on the first token, per layer"),
    ]
    index = write_index(out, f"{name}: attention over {n} tokens", entries)
    progress.step("done")
    files = [str(index)] + [str(out / e.file) for e in entries]
    if args.json:
        print_json({"index": str(index), "files": files})
    else:
        print(f"{len(files)} files in {args.out}; open {index}")
    return 0
