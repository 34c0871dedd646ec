"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus) sampling.

Shape notation: ``B`` batch, ``V`` vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.functional._checks import check_finite_logits, check_int, check_real

__all__ = ["check_sampling", "next_token", "top_k_filter", "top_p_filter"]


def check_sampling(
    *, do_sample: bool, temperature: float, top_k: int | None, top_p: float | None
) -> None:
    """Validate sampling settings.

    Raises:
        TypeError: a setting that is not a number.
        ValueError: ``temperature`` not finite and > 0 with sampling, ``top_k < 1``, or
            ``top_p`` outside ``(0, 1]`` (NaN included).
    """
    if do_sample:
        check_real("temperature", temperature, gt=0.0)
    if top_k is not None:
        check_int("top_k", top_k, min_value=1)
    if top_p is not None:
        check_real("top_p", top_p, gt=0.0, le=1.0)


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Keep the ``k`` largest logits of each row (and ties with the k-th), set the rest to ``-inf``.

    Top-k sampling (Fan et al., 2018). ``logits``: ``[B, V]``.
    """
    k = min(k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # [B, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Nucleus filtering (Holtzman et al., 2020): keep the smallest set of most likely tokens
    whose probability reaches ``p``, set the rest to ``-inf``.

    A token is kept when the probability of the tokens ranked above it is below ``p``;
    the most likely token is always kept. ``logits``: ``[B, V]``.
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [B, V]
    probs = torch.softmax(sorted_logits.float(), dim=-1)
    mass_above = probs.cumsum(dim=-1) - probs  # [B, V]
    remove_sorted = mass_above >= p
    remove_sorted[..., 0] = False
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def next_token(
    logits: Tensor,
    *,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    step: int = 0,
) -> Tensor:
    """The next token of each row: argmax, or a sample after temperature, top-k and top-p.

    The order (temperature, then top-k, then top-p) is transformers'.

    Args:
        logits: ``[B, V]``.
        do_sample: sample instead of taking the argmax.
        temperature: divides the logits (sampling only).
        top_k: keep the ``k`` most likely tokens (sampling only).
        top_p: keep the nucleus of mass ``p`` (sampling only).
        generator: the random generator (for reproducible samples).
        step: the decoding step, named in the error on non-finite logits.

    Returns:
        Long ``[B]``.

    Raises:
        NonFiniteError: a row's logits hold NaN or ``+inf``, or are all ``-inf`` (one
            reduction and one host sync per call; see
            :func:`attnlab.functional._checks.check_finite_logits`).
    """
    check_finite_logits(logits, step=step)
    if not do_sample:
        return logits.argmax(dim=-1)
    scores = logits.float() / temperature
    if top_k is not None:
        scores = top_k_filter(scores, top_k)
    if top_p is not None:
        scores = top_p_filter(scores, top_p)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
