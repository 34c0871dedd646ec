"""Choosing the next token from logits: the batched tensor operations of sampling.

Greedy, temperature, top-k, top-p (nucleus) and min-p filtering, repetition / frequency /
presence penalties and token bitmasks (grammar-constrained decoding), each on a ``[B, V]``
batch with per-row settings. :func:`next_token` is what ``generate`` calls;
:mod:`attnlab.generation.sampler` assembles per-request settings into these operations
for the serving engine.

Shape notation: ``B`` batch, ``V`` vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.functional._checks import (
    check_finite_logits,
    check_int,
    check_real,
    refuse_nonfinite_max,
)

__all__ = [
    "apply_penalties",
    "check_sampling",
    "greedy_token",
    "min_p_filter",
    "next_token",
    "sample_with_noise",
    "top_k_filter",
    "top_p_filter",
    "unpack_bitmask",
]


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


def _per_row(value: float | Tensor, logits: Tensor) -> Tensor:
    """``value`` as a ``[B, 1]`` float32 tensor (a scalar is broadcast to every row)."""
    if isinstance(value, Tensor):
        return value.to(device=logits.device, dtype=torch.float32).reshape(-1, 1)
    return torch.full((logits.shape[0], 1), float(value), device=logits.device)


def top_k_filter(logits: Tensor, k: int | Tensor) -> Tensor:
    """Keep the ``k`` largest logits of each row (and ties with the k-th), set the rest to ``-inf``.

    Top-k sampling (Fan et al., 2018). ``logits``: ``[B, V]``; ``k`` an int, or a long
    ``[B]`` tensor of per-row values where ``0`` (or ``>= V``) leaves a row unfiltered.
    """
    v = logits.shape[-1]
    if not isinstance(k, Tensor):
        k = min(k, v)
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # [B, 1]
        return logits.masked_fill(logits < kth, float("-inf"))
    k = k.to(device=logits.device, dtype=torch.long).reshape(-1)
    k = torch.where((k <= 0) | (k > v), v, k)  # [B]
    top = torch.topk(logits, int(k.max()), dim=-1).values  # [B, k_max], descending
    kth = top.gather(-1, (k - 1)[:, None])  # [B, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Tensor, p: float | Tensor) -> Tensor:
    """Nucleus filtering (Holtzman et al., 2020): keep the smallest set of most likely tokens
    whose probability reaches ``p``, set the rest to ``-inf``.

    A token is kept when the probability of the tokens ranked above it is below ``p``;
    the most likely token is always kept. ``logits``: ``[B, V]``; ``p`` a float or a
    ``[B]`` tensor of per-row values (``1`` leaves a row unfiltered).
    """
    if not isinstance(p, Tensor) and p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [B, V]
    probs = torch.softmax(sorted_logits.float(), dim=-1)
    mass_above = probs.cumsum(dim=-1) - probs  # [B, V]
    remove_sorted = (mass_above >= _per_row(p, logits)) & (_per_row(p, logits) < 1.0)
    remove_sorted[..., 0] = False
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def min_p_filter(logits: Tensor, min_p: float | Tensor) -> Tensor:
    """Min-p filtering (Nguyen et al., 2024, "Turning Up the Heat: Min-p Sampling"): drop
    the tokens whose probability is below ``min_p`` times the most likely token's.

    ``logits``: ``[B, V]``; ``min_p`` a float or a ``[B]`` tensor in ``[0, 1]`` (0 keeps
    every token). The most likely token is always kept.
    """
    probs = torch.softmax(logits.float(), dim=-1)  # [B, V]
    floor = _per_row(min_p, logits) * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    return logits.masked_fill(probs < floor, float("-inf"))


def apply_penalties(
    logits: Tensor,
    *,
    output_counts: Tensor,
    seen: Tensor | None = None,
    presence: Tensor | None = None,
    frequency: Tensor | None = None,
    repetition: Tensor | None = None,
) -> Tensor:
    """Repetition, frequency and presence penalties, per row (the semantics of vLLM and the
    OpenAI API).

    - ``repetition`` (Keskar et al., 2019, CTRL): a token in ``seen`` (prompt or output) has
      its logit divided by the penalty when positive, multiplied when negative.
    - ``frequency``: subtracts ``penalty * count`` of the token in the output.
    - ``presence``: subtracts ``penalty`` once from every token present in the output.

    Args:
        logits: ``[B, V]`` float.
        output_counts: ``[B, V]`` how often each token occurs in each row's output.
        seen: ``[B, V]`` bool, tokens in the prompt or the output (for ``repetition``).
        presence, frequency, repetition: ``[B]`` per-row penalties (0, 0 and 1 are off).

    Returns:
        ``[B, V]``, a new tensor.
    """
    out = logits.float()
    if repetition is not None:
        assert seen is not None, "the repetition penalty needs the seen tokens"
        rep = torch.where(seen, repetition.float()[:, None], 1.0)  # [B, V]
        out = torch.where(out > 0, out / rep, out * rep)
    if frequency is not None:
        out = out - frequency.float()[:, None] * output_counts
    if presence is not None:
        out = out - presence.float()[:, None] * (output_counts > 0)
    return out


def unpack_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """A token bitmask as bools: ``[B, ceil(V/32)]`` int32 (bit ``i % 32`` of word ``i // 32``
    set = token ``i`` allowed, the layout of llguidance and xgrammar) to ``[B, V]`` bool."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = (bitmask.unsqueeze(-1) >> bits) & 1  # [B, W, 32]
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def sample_with_noise(probs: Tensor, noise: Tensor) -> Tensor:
    """Draw one token per row from ``probs`` given exponential noise: ``argmax(probs / noise)``
    with ``noise ~ Exp(1)`` (the exponential race; a row's draw depends on its own noise
    only, so rows with their own generators sample independently in one batch).

    ``probs``, ``noise``: ``[B, V]``. Returns long ``[B]``.
    """
    return (probs / noise).argmax(dim=-1)


#: Vocabulary entries per block of :func:`greedy_token`'s first pass.
GREEDY_BLOCK = 128


def greedy_token(logits: Tensor) -> tuple[Tensor, Tensor]:
    """``(max, argmax)`` of each row of ``logits [B, V]``: ``logits.max(-1)``, faster.

    torch's CPU ``argmax`` over a long row does not vectorize (8 x 32000 float32 took
    ~0.5 ms on one core, ``amax`` ~0.02 ms), so the rows are read once in blocks of
    :data:`GREEDY_BLOCK` by ``amax``; the first block holding the row's maximum is
    searched by ``argmax``. The index is the first maximal entry, as ``argmax``'s
    (NaN counts as the maximum, as there); the maxima go to the non-finite check.

    Returns:
        ``(values [B], indices [B] long)``.
    """
    b, v = logits.shape
    n = v - v % GREEDY_BLOCK
    if n == 0 or logits.stride(-1) != 1:
        values, indices = logits.max(dim=-1)
        return values, indices
    blocks = logits[:, :n].unflatten(-1, (n // GREEDY_BLOCK, GREEDY_BLOCK))  # [B, n/blk, blk]
    maxima = blocks.amax(dim=-1)  # [B, n/blk]
    best = maxima.argmax(dim=-1)  # [B], the first block holding the maximum
    rows = torch.arange(b, device=logits.device)
    indices = best * GREEDY_BLOCK + blocks[rows, best].argmax(dim=-1)  # [B]
    values = maxima[rows, best]
    if n < v:  # the tail past the last whole block
        tail_values, tail_indices = logits[:, n:].max(dim=-1)
        later = (tail_values > values) | (tail_values.isnan() & ~values.isnan())
        indices = torch.where(later, tail_indices + n, indices)
        values = torch.where(later, tail_values, values)
    return values, indices


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
    if not do_sample:
        top, tok = greedy_token(logits)
        refuse_nonfinite_max(top, step=step)
        return tok
    check_finite_logits(logits, step=step)
    scores = logits.float() / temperature
    if top_k is not None:
        scores = top_k_filter(scores, top_k)
    if top_p is not None:
        scores = top_p_filter(scores, top_p)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
