"""``attnlab generate``: stream tokens from a small model to the terminal.

The model is a local transformers folder (config.json + safetensors, with its
tokenizer if the folder has one) or a random tiny model for a quick try, whose
"tokenizer" is UTF-8 bytes (vocabulary 256).
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path
from typing import Any

from attnlab.cli._common import (
    nonnegative_int,
    positive_float,
    positive_int,
    print_json,
    probability_float,
    seed_int,
    token_ids,
)

RANDOM_ARCHS = ("gpt2", "llama", "mistral", "bloom", "t5")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text with a local transformers model or a random tiny one",
        description="Stream generated tokens to the terminal.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="a local transformers model folder or a .gguf file")
    src.add_argument(
        "--random", choices=RANDOM_ARCHS, help="a random tiny model of this architecture"
    )
    p.add_argument("--prompt", help="the prompt text")
    p.add_argument(
        "--ids",
        type=token_ids,
        help="the prompt as token ids separated by spaces or commas (instead of text)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=nonnegative_int,
        default=32,
        help="the most tokens to generate (default 32; fewer at --eos)",
    )
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument(
        "--temperature",
        type=positive_float,
        default=None,
        help="with --sample: divide the logits by this (default 1.0)",
    )
    p.add_argument(
        "--top-k",
        type=positive_int,
        default=None,
        help="with --sample: draw among the K most likely tokens only",
    )
    p.add_argument(
        "--top-p",
        type=probability_float,
        default=None,
        help="with --sample: draw from the smallest set of tokens whose probability reaches P "
        "(nucleus sampling), P in (0, 1]",
    )
    p.add_argument("--eos", type=nonnegative_int, default=None, help="end-of-sequence token id")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the random model and sampler")
    p.add_argument(
        "--json",
        action="store_true",
        help="print the prompt and generated ids (and text) as JSON when done, not streamed",
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile the model's decode step with torch.compile over a static cache "
        "(decoder-only models; the first tokens wait for the compile, whose seconds are "
        "reported on stderr). Default: generate's own rule, its fastest exact path (it "
        "compiles when the graph pays for itself: 128+ new tokens and no EOS, or a graph "
        "of this shape compiled already); --no-compile decodes eagerly",
    )
    p.add_argument(
        "--sink-window",
        type=positive_int,
        default=None,
        metavar="W",
        help="decode through an attention-sink cache (StreamingLLM, Xiao et al., 2023): the "
        "first --sinks tokens and the newest W, positions within the cache, so the text can "
        "run past the model's context at a fixed memory (decoders with RoPE, ALiBi or no "
        "positions)",
    )
    p.add_argument(
        "--sinks",
        type=nonnegative_int,
        default=None,
        help="with --sink-window: first tokens kept for ever (default 4; 0 = a plain window)",
    )
    p.set_defaults(func=run)


def _compile_note(model: Any, before: int) -> list[dict[str, Any]]:
    """The decode-step compiles this run paid for, said on stderr (never hidden in the
    first tokens' latency) and returned for ``--json``."""
    from attnlab.generation.compiled import compile_report

    done = [
        {"batch_size": r.batch_size, "cache_slots": r.slots, "seconds": round(r.seconds, 3)}
        for r in compile_report(model)[before:]
    ]
    for r in done:
        print(
            f"note: compiled the decode step in {r['seconds']:.1f} s (batch {r['batch_size']}, "
            f"{r['cache_slots']} cache slots; later runs of this shape reuse the graph)",
            file=sys.stderr,
        )
    return done


def _sink_cache(args: argparse.Namespace, model: Any) -> Any:
    """The ``--sink-window`` cache, or None; refuses what a sink cache cannot honour."""
    if args.sink_window is None:
        if args.sinks is not None:
            raise ValueError("--sinks applies to a sink cache only: add --sink-window W")
        return None
    if args.compile:
        raise ValueError(
            "--sink-window decodes eagerly (its sinks move every step): drop --compile"
        )
    if getattr(model, "is_encoder_decoder", False):
        raise ValueError(
            f"--sink-window streams a decoder-only model; {type(model).__name__} is an "
            "encoder-decoder"
        )
    from attnlab.generation import sink_cache

    sinks = 4 if args.sinks is None else args.sinks
    return sink_cache(model, window=args.sink_window, sinks=sinks)


class _Bytes:
    """A byte-level tokenizer for the random models; unprintable bytes show as ``\\xNN``."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) if 32 <= i < 127 else f"\\x{i:02x}" for i in ids)


def random_model(arch: str, seed: int) -> Any:
    """A random tiny attnlab model of ``arch`` with a 256-token (byte) vocabulary."""
    import torch

    from attnlab.models.decoder import DecoderLM
    from attnlab.models.decoder_config import DecoderConfig
    from attnlab.models.seq2seq import Seq2SeqLM
    from attnlab.models.seq2seq_config import Seq2SeqConfig

    torch.manual_seed(seed)
    if arch == "t5":
        return Seq2SeqLM(
            Seq2SeqConfig.t5(vocab_size=256, d_model=64, d_ff=128, num_layers=2, num_heads=4)
        ).eval()
    sizes: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=1024,
    )
    config = {
        "gpt2": lambda: DecoderConfig.gpt2(**sizes),
        "llama": lambda: DecoderConfig.llama(**sizes, num_key_value_heads=2),
        "mistral": lambda: DecoderConfig.mistral(**sizes, num_key_value_heads=2, sliding_window=64),
        "bloom": lambda: DecoderConfig.bloom(**(sizes | {"intermediate_size": 256})),
    }[arch]()
    return DecoderLM(config).eval()


def _tokenizer(folder: Path) -> Any:
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from attnlab.interop.hf import require_transformers

    try:
        return require_transformers().AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError, TypeError) as e:
        from attnlab.errors import ModelFileError

        raise ModelFileError(f"{folder}: the tokenizer cannot be loaded: {e}") from None


def run(args: argparse.Namespace) -> int:
    from attnlab.cli._common import use_inductor_cache

    use_inductor_cache()  # before torch.compile is first called (it sets the variable)
    from attnlab.backends.gemm_cache import persisted_choices

    with persisted_choices():  # --compile lays the linears out: as every earlier start did
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    import torch

    import attnlab

    given = [f for f in ("temperature", "top_k", "top_p") if getattr(args, f) is not None]
    if given and not args.sample:
        flags = ", ".join("--" + f.replace("_", "-") for f in given)
        raise ValueError(f"{flags} apply to sampling only: add --sample, or drop them")
    if args.model is not None:
        model = attnlab.from_hf(args.model)
        tokenizer = model.tokenizer if args.model.is_file() else _tokenizer(args.model)
    else:
        model = random_model(args.random, args.seed)
        tokenizer = _Bytes()
    if args.ids is not None:
        prompt = list(args.ids)
    elif args.prompt is not None:
        if tokenizer is None:
            raise ValueError(f"{args.model} has no tokenizer files: pass the prompt with --ids")
        prompt = list(tokenizer.encode(args.prompt))
    else:
        raise ValueError("pass a prompt with --prompt TEXT or --ids '1 2 3'")
    if not prompt:
        raise ValueError("the prompt is empty")
    if args.compile and model.is_encoder_decoder:
        raise ValueError(
            f"--compile compiles a decoder-only model's decode step; "
            f"{type(model).__name__} is an encoder-decoder: drop --compile"
        )
    cache = _sink_cache(args, model)
    vocab = model.config.vocab_size
    if max(prompt) >= vocab:
        raise ValueError(
            f"--ids: token id {max(prompt)} is outside the model's vocabulary [0, {vocab})"
        )
    if args.random is not None:  # said once the arguments are known to be good
        print(
            f"note: --random {args.random} is an untrained model with random weights "
            f"(seed {args.seed}): its output is noise, useful to try the command only",
            file=sys.stderr,
        )
    eos = args.eos if args.eos is not None else getattr(model.config, "eos_token_id", None)
    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.tensor([prompt])
    out: Any = sys.stdout if not args.json else io.StringIO()  # --json: print at the end
    # Decode the whole text each step and print what it adds: tokenizers join pieces
    # (spaces, multi-byte characters) only in context.
    context = [] if model.is_encoder_decoder else prompt
    shown = ""
    if tokenizer is not None:
        shown = tokenizer.decode(context)
        out.write(shown)
        out.flush()
    new: list[int] = []
    from attnlab.generation.compiled import compile_report

    before = len(compile_report(model))
    for tok in model.stream(
        ids,
        args.max_new_tokens,
        do_sample=args.sample,
        temperature=1.0 if args.temperature is None else args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_token_id=eos,
        generator=generator,
        compile=args.compile,
        cache=cache,
    ):
        new.append(int(tok[0]))
        if tokenizer is None:
            out.write(f" {new[-1]}")
        else:
            text = tokenizer.decode(context + new)
            out.write(text[len(shown) :] if text.startswith(shown) else text)
            shown = text
        out.flush()
    out.write("\n")
    compiles = _compile_note(model, before)
    if args.json:
        result: dict[str, Any] = {"prompt_ids": prompt, "new_ids": new, "compile": compiles}
        if tokenizer is not None:
            result["text"] = tokenizer.decode(new)
        print_json(result)
    return 0
