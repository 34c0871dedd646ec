"""Speculative decoding in the serving engine: drafts verified in the step's forward.

Two drafters: prompt lookup (below) and a draft model (:mod:`attnlab.serving.draft_model`,
which drafts after scheduling into slots the scheduler reserved); both are verified here.

Prompt lookup (Saxena, 2023) drafts the tokens that followed the latest earlier
occurrence of a sequence's last n-gram (longest n first); it costs no model, and it is
strong when the output repeats spans of the prompt (edits, code changes, quoting
summaries). In the engine, each decoding sequence's drafts are extra query tokens of its
row of the step's flat forward (attention through the ``document`` pattern over the
paged KV, exactly as a prefill chunk), so one forward scores the last token and every
draft of every sequence. Verification (:func:`accepted_prefix`) keeps the drafts the
sampler itself would have chosen: position ``i``'s logits are sampled with the
sequence's settings as if the drafts before it were already output (penalties,
``min_tokens``), and draft ``i`` is kept when the token chosen there equals it.

Greedy rows keep the longest prefix that equals the argmax, then the argmax after it:
plain greedy output. Sampling rows keep draft ``d_i`` with probability ``p_i(d_i)`` and,
at the first rejection, draw from ``p_i`` without ``d_i``: that is the rejection rule of
speculative sampling (Leviathan et al., 2023; Chen et al., 2023) for a deterministic
draft, so the output is distributed as plain sampling. A seeded request's generator is
rewound to the draws of the kept tokens only (:class:`GeneratorRewind`), so it draws the
very tokens plain decoding draws.

The KV of the rejected drafts is cut off (:meth:`~attnlab.cache.paged.manager.KVManager.truncate`):
their slots are forgotten and the blocks only they needed go back to the pool; they
were never committed, so no prefix-cache hash includes them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from attnlab._validate import check_int
from attnlab.generation.sampler import skip_draws
from attnlab.generation.speculative import NgramIndex  # moved down there; re-exported

__all__ = [
    "SPECULATIVE_METHODS",
    "GeneratorRewind",
    "NgramIndex",
    "SpeculativeConfig",
    "accepted_prefix",
    "check_speculative",
]

#: The drafters the engine offers.
SPECULATIVE_METHODS = ("prompt_lookup", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """The engine's speculative settings.

    Attributes:
        method: ``"prompt_lookup"`` or ``"draft"`` (a draft model).
        num_tokens: drafts per sequence and step at most.
        max_ngram: the longest n-gram prompt lookup matches.
    """

    method: str
    num_tokens: int
    max_ngram: int

    def drafter(self, max_model_len: int) -> Callable[[Any, int], list[int] | int]:
        """The scheduler's ``drafter(seq, at_most)`` for a decoding engine sequence:
        prompt-lookup drafts, or (a draft model) how many slots to reserve for the drafts
        the model makes after scheduling; as many as its ``max_tokens`` and the context
        leave room for (the verified token comes on top); none for a grammar-constrained
        sequence (its parser state cannot be rewound) or one whose first token is due."""

        def draft(seq: Any, at_most: int) -> list[int] | int:
            if not seq.output_ids or seq.matcher is not None:
                return []
            k = min(
                self.num_tokens,
                at_most,
                seq.request.params.max_tokens - len(seq.output_ids) - 1,
                max_model_len - seq.num_tokens - 1,
            )
            if k <= 0:
                return []
            if self.method == "draft":
                return k
            if seq.lookup is None:
                seq.lookup = NgramIndex(self.max_ngram)
            return seq.lookup.draft(seq.tokens, k)  # type: ignore[no-any-return]

        return draft


def check_speculative(
    speculative: str | None,
    num_speculative_tokens: int,
    max_ngram: int,
    specs: Sequence[str],
    draft_model: object = None,
) -> SpeculativeConfig | None:
    """The engine's speculative settings, checked, or None when off.

    Raises:
        ValueError: an unknown method, a count that is not a positive int, a model
            with recurrent layers (a state cannot be cut back to the kept tokens), or
            ``draft_model`` given without ``speculative="draft"`` or missing with it.
    """
    if speculative is not None and speculative not in SPECULATIVE_METHODS:
        raise ValueError(
            f"speculative must be None or one of {list(SPECULATIVE_METHODS)}, got {speculative!r}"
        )
    if (speculative == "draft") != (draft_model is not None):
        raise ValueError(
            "draft_model is what speculative='draft' drafts with: give both or neither "
            f"(got speculative={speculative!r}, draft_model="
            f"{'None' if draft_model is None else type(draft_model).__name__})"
        )
    if speculative is None:
        return None
    check_int("num_speculative_tokens", num_speculative_tokens, min_value=1)
    check_int("speculative_max_ngram", max_ngram, min_value=1)
    if "state" in specs:
        raise ValueError(
            f"speculative={speculative!r}: the model has recurrent layers, whose state "
            "advances over every drafted token and cannot be cut back to the accepted "
            "ones; serve it without speculative decoding"
        )
    return SpeculativeConfig(speculative, num_speculative_tokens, max_ngram)


def accepted_prefix(drafts: Sequence[int], chosen: Sequence[int]) -> int:
    """How many drafts are kept: the longest prefix equal to the tokens the sampler chose
    at their positions (``chosen[i]`` after the drafts before ``i``)."""
    return next((i for i, (d, t) in enumerate(zip(drafts, chosen)) if d != t), len(drafts))


class GeneratorRewind:
    """A seeded row's generator, rewound to the draws of the kept positions.

    The sampler draws one float64 uniform per sampled position from a seeded request's
    generator (:func:`~attnlab.generation.sampler.draw_uniforms`). Verifying ``k``
    drafts draws ``k + 1`` of them; plain decoding would have drawn one per kept token,
    so after verification the generator is put back and advanced by the kept positions
    only (:func:`~attnlab.generation.sampler.skip_draws`, the same calls).
    """

    def __init__(self, generator: torch.Generator, vocab: int) -> None:
        self.generator = generator
        self.vocab = vocab  # the draws no longer depend on it (one number per position)
        self.state = generator.get_state()

    def keep(self, positions: int) -> None:
        """Leave the generator as if it had drawn ``positions`` positions since the mark."""
        self.generator.set_state(self.state)
        skip_draws(self.generator, positions)
