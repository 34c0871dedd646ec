"""``attnlab convert IN OUT``: between GGUF files and model folders.

IN is a ``.gguf`` file or a model folder (config.json + safetensors); OUT ending in
``.gguf`` is written by :func:`attnlab.to_gguf` (``--dtype f32|f16|q8_0|q4_0|q4_1``), any
other OUT is written as a transformers folder (config, safetensors, tokenizer) that
``attnlab serve``, ``chat`` and transformers load. ``--quantize int8|int4|...`` quantizes
the weights on the way (:func:`attnlab.models.quantize.quantize_model`): a ``.gguf`` OUT
holds the layers as Q8_0 (``int8:g32``) or Q4_1 (``int4``) blocks, a folder OUT is
written by :func:`attnlab.interop.quantized.save_quantized` (the layout recorded), which
``serve``, ``chat`` and ``generate`` load as stored.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="convert between .gguf files and model folders (GGUF for llama.cpp / ollama)",
        description=(
            "Convert IN (a .gguf file or a model folder) to OUT: a .gguf file (for llama.cpp, "
            "ollama, transformers) or a transformers model folder."
        ),
        epilog="examples:\n  attnlab convert runs/stdlib-bpe/model stdlib-bpe.q8_0.gguf --dtype q8_0\n"
        "  attnlab convert SmolLM2-135M-Instruct smollm2-int4 --quantize int4",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("input", type=Path, metavar="IN", help="a .gguf file or a model folder")
    p.add_argument("output", type=Path, metavar="OUT", help="a .gguf file or a folder")
    p.add_argument(
        "--dtype",
        choices=("f32", "f16", "q8_0", "q4_0", "q4_1"),
        default=None,
        help="type of the matrices in an OUT .gguf (default f32, or the --quantize layout; "
        "norms stay f32)",
    )
    p.add_argument(
        "--quantize",
        choices=QUANTIZE_CHOICES,
        default=None,
        help="quantize the weights: int8 (per channel; folders only), int8:g32 (= GGUF Q8_0), "
        "int4 / int4:g32 (= GGUF Q4_1), int4:g64, int4:g128 (folders only)",
    )
    p.add_argument(
        "--json", action="store_true", help="print what was written (path, MiB, source) as JSON"
    )
    p.set_defaults(func=run)


#: ``--quantize`` values (LinearSpec strings)
QUANTIZE_CHOICES = ("int8", "int8:g32", "int4", "int4:g32", "int4:g64", "int4:g128")
#: the ``--quantize`` values a GGUF file holds exactly
GGUF_QUANTIZE = ("int8:g32", "int4", "int4:g32")


def run(args: argparse.Namespace) -> int:
    from attnlab.cli._common import writable_file
    from attnlab.interop.causal_lm import load_causal_lm

    to_gguf = args.output.suffix.lower() == ".gguf"
    if to_gguf:
        writable_file("OUT", args.output)
    elif args.output.exists() and not args.output.is_dir():
        raise OSError(17, f"OUT {str(args.output)!r} exists and is not a folder")
    elif args.dtype is not None:
        raise ValueError(f"--dtype {args.dtype} applies to a .gguf OUT; {args.output} is a folder")
    if to_gguf and args.quantize is not None:
        if args.quantize not in GGUF_QUANTIZE:
            raise ValueError(
                f"--quantize {args.quantize} has no GGUF block type; for a .gguf OUT use one of "
                f"{list(GGUF_QUANTIZE)} (or write a folder)"
            )
        if args.dtype is not None:
            raise ValueError(
                f"--dtype {args.dtype} and --quantize {args.quantize} both choose the matrices' "
                "type: pass one"
            )
    lm = load_causal_lm(args.input, progress=True)
    if args.quantize is not None:
        from attnlab.models.quantize import quantize_model

        quantize_model(lm.model, args.quantize)
    if to_gguf:
        import attnlab

        dtype = args.dtype if args.dtype is not None or args.quantize else "f32"
        attnlab.to_gguf(lm.model, args.output, dtype=dtype, tokenizer=lm.tokenizer)
    elif args.quantize is not None:
        from attnlab.interop.quantized import save_quantized

        save_quantized(lm.model, args.output)
        _SavesTo(lm.tokenizer).save(args.output)
    else:
        from attnlab.train.export import export_model

        export_model(lm.model, args.output, tokenizer=_SavesTo(lm.tokenizer))
    size = sum(f.stat().st_size for f in _files(args.output)) / 2**20
    if args.json:
        from attnlab.cli._common import print_json

        print_json({"out": str(args.output), "mib": size, "from": str(args.input)})
    print(f"wrote {args.output} ({size:.1f} MiB) from {args.input}", file=sys.stderr)
    return 0


class _SavesTo:
    """A transformers tokenizer behind ``save(folder)``, the call ``export_model`` makes."""

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer

    def save(self, folder: Path) -> None:
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(folder))  # type: ignore[attr-defined]


def _files(path: Path) -> list[Path]:
    return [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
