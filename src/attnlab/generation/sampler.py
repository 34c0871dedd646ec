"""The sampler of a decoding step: per-row settings applied to a batch of logits at once.

Each row of a step's ``[B, V]`` logits belongs to a request with its own settings
(temperature, top-k/top-p/min-p, penalties, ``logit_bias``, tokens banned this step,
a grammar's token mask, a seeded generator). :func:`sample` turns them into per-row
tensors and applies each operation of :mod:`attnlab.functional.sampling` once to the
whole batch, skipping operations no row uses, in vLLM's order:

1. the log-probabilities returned to a client, from the model's logits as they are
   (vLLM's default, ``raw_logprobs``);
2. grammar masks (constrained rows only), ``logit_bias``, banned tokens (EOS before
   ``min_tokens``);
3. repetition, frequency and presence penalties;
4. greedy rows take the argmax here; the others are divided by their temperature,
   filtered by min-p, top-k and top-p, and draw one token by the inverse CDF at one
   float64 uniform per row (a seeded row draws it from its own generator, so its samples
   do not depend on its neighbours in the batch).

A row whose logits cannot give a token (NaN, ``+inf``, or every token masked) fails
alone: it is reported in :attr:`SampleOutput.failed` and the other rows are sampled.

Shape notation: ``B`` rows, ``V`` vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from attnlab.functional.sampling import (
    apply_penalties,
    min_p_filter,
    top_k_filter,
    top_p_filter,
    unpack_bitmask,
)

__all__ = [
    "GREEDY_BELOW",
    "RowSampling",
    "SampleOutput",
    "SamplingSettings",
    "draw_uniforms",
    "inverse_cdf",
    "sample",
    "sampling_probs",
    "skip_draws",
    "speculative_verify",
    "token_logprobs",
]

#: A temperature below this samples greedily: dividing logits by ``1e-5`` already puts
#: every token but the argmax (and its exact ties) below ``exp(-1e4)`` in probability,
#: and a smaller divisor would overflow float32 (``temperature=1e-300`` gives ``inf``).
#: vLLM uses the same threshold (``_SAMPLING_EPS``).
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingSettings:
    """What a request asks of the sampler (validated by the caller).

    Attributes:
        temperature: below :data:`GREEDY_BELOW` the row is greedy.
        top_k: keep the ``k`` most likely tokens; 0 is off.
        top_p: nucleus mass in ``(0, 1]``; 1 is off.
        min_p: keep tokens at least ``min_p`` times as likely as the top one; 0 is off.
        presence_penalty, frequency_penalty: over the generated tokens; 0 is off.
        repetition_penalty: over prompt and generated tokens; 1 is off.
        logit_bias: token id -> value added to its logit.
        logprobs: how many top log-probabilities to return per token, or None.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass
class RowSampling:
    """One row of a step: its settings and what they need from the sequence.

    Attributes:
        settings: the request's settings.
        prompt_ids: the prompt (for the repetition penalty).
        output_ids: the tokens generated so far (penalties).
        banned: tokens that may not be chosen at this step.
        generator: the row's own random generator (a seeded request), or None.
        bitmask_row: the row of the step's grammar bitmask holding this row's mask.
    """

    settings: SamplingSettings
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    banned: Sequence[int] = ()
    generator: torch.Generator | None = None
    bitmask_row: int | None = None


@dataclass
class SampleOutput:
    """The chosen tokens of a step.

    Attributes:
        tokens: one token id per row (``-1`` for a failed row).
        logprobs: per row, ``(chosen token's logprob, [(token, logprob)] of the top
            ones)`` when the row asked for logprobs, else None.
        failed: row -> why no token could be chosen.
    """

    tokens: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]
    failed: dict[int, str]


def _column(rows: Sequence[RowSampling], name: str, off: float) -> Tensor | None:
    values = [float(getattr(r.settings, name)) for r in rows]
    if all(v == off for v in values):
        return None
    return torch.tensor(values)


def _counts(rows: Sequence[RowSampling], vocab: int, *, prompt: bool) -> Tensor:
    """``[B, V]`` occurrences of each token in each row's output (and prompt)."""
    seqs = [list(r.output_ids) + (list(r.prompt_ids) if prompt else []) for r in rows]
    width = max(1, max(len(s) for s in seqs))
    ids = torch.full((len(rows), width), vocab, dtype=torch.long)  # ``vocab``: padding
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    counts = torch.zeros(len(rows), vocab + 1)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


def _penalise(x: Tensor, rows: Sequence[RowSampling]) -> Tensor:
    presence = _column(rows, "presence_penalty", 0.0)
    frequency = _column(rows, "frequency_penalty", 0.0)
    repetition = _column(rows, "repetition_penalty", 1.0)
    if presence is None and frequency is None and repetition is None:
        return x
    vocab = x.shape[-1]
    out_counts = _counts(rows, vocab, prompt=False)
    seen = _counts(rows, vocab, prompt=True) > 0 if repetition is not None else None
    return apply_penalties(
        x,
        output_counts=out_counts,
        seen=seen,
        presence=presence,
        frequency=frequency,
        repetition=repetition,
    )


def _bias_and_ban(x: Tensor, rows: Sequence[RowSampling]) -> None:
    r_idx: list[int] = []
    c_idx: list[int] = []
    vals: list[float] = []
    ban_r: list[int] = []
    ban_c: list[int] = []
    for i, r in enumerate(rows):
        for tok, bias in r.settings.logit_bias.items():
            r_idx.append(i)
            c_idx.append(int(tok))
            vals.append(float(bias))
        ban_r += [i] * len(r.banned)
        ban_c += [int(t) for t in r.banned]
    if vals:
        x.index_put_(
            (torch.tensor(r_idx), torch.tensor(c_idx)), torch.tensor(vals), accumulate=True
        )
    if ban_r:
        x[torch.tensor(ban_r), torch.tensor(ban_c)] = float("-inf")


def _raw_logprobs(
    logits: Tensor, rows: Sequence[RowSampling]
) -> tuple[list[int], Tensor | None, Tensor | None, Tensor | None]:
    want = [i for i, r in enumerate(rows) if r.settings.logprobs is not None]
    if not want:
        return want, None, None, None
    logp = torch.log_softmax(logits[want].float(), dim=-1)  # [b, V]
    k = max(int(rows[i].settings.logprobs or 0) for i in want)
    if k == 0:
        return want, logp, None, None
    vals, idx = logp.topk(k, dim=-1)  # [b, k]
    return want, logp, vals, idx


def draw_uniforms(rows: Sequence[RowSampling], fallback: torch.Generator | None) -> Tensor:
    """float64 ``[b]``: one uniform in ``[0, 1)`` per row, the only randomness a sampled row
    uses. Rows without a generator share one call on ``fallback``; a seeded row draws
    ``torch.rand(1, dtype=float64)`` from its own generator, so its stream is one such
    draw per sampled position whatever its neighbours (:func:`skip_draws` replays them)."""
    u = torch.empty(len(rows), dtype=torch.float64)
    shared = [j for j, r in enumerate(rows) if r.generator is None]
    if shared:
        u[shared] = torch.rand(len(shared), dtype=torch.float64, generator=fallback)
    for j, r in enumerate(rows):
        if r.generator is not None:
            u[j] = torch.rand(1, dtype=torch.float64, generator=r.generator)[0]
    return u


def skip_draws(generator: torch.Generator, count: int) -> None:
    """Advance a seeded row's generator by ``count`` sampled positions (what
    :func:`draw_uniforms` draws from it for ``count`` rows)."""
    for _ in range(count):
        torch.rand(1, dtype=torch.float64, generator=generator)


def _draw(
    x: Tensor,
    top: Tensor,
    rows: Sequence[RowSampling],
    sampled: list[int],
    fallback: torch.Generator | None,
) -> Tensor:
    """One token for each row in ``sampled``: temperature, min-p, top-k, top-p, then the
    inverse CDF of the row's distribution at one uniform.

    ``exp(z - max z)`` (the softmax before normalising) is summed in float64 and the token
    is the first whose running sum exceeds ``u`` times the total (:func:`inverse_cdf`):
    it has probability ``w_i / sum(w)`` up to float64 rounding, and a token of weight 0
    (filtered, masked, or underflowed) is never chosen. It draws one number per row where the exponential
    race (``argmax(p / Exp(1))``) draws ``V``: at ``[8, 32000]`` the race's noise cost more
    than the 32000-row output head (issue 21).
    """
    sub = [rows[i] for i in sampled]
    temps = torch.tensor([r.settings.temperature for r in sub])
    every = len(sampled) == x.shape[0]
    z = (x if every else x[sampled]) / temps[:, None]  # [b, V]
    # the row maxima of z, exactly (division by a positive temperature is monotone and
    # rounding keeps the order); the filters below never remove the maximum
    z_max = (top if every else top[sampled]) / temps  # [b]
    z = _filtered(z, sub)
    w = torch.exp(z - z_max[:, None])  # [b, V] in [0, 1], 1 at the maximum
    return inverse_cdf(w, draw_uniforms(sub, fallback))


#: Tokens per block of :func:`inverse_cdf`'s two-level search.
_BLOCK = 256


def _first_above(c: Tensor, x: Tensor) -> Tensor:
    """Per row, the first index whose running sum ``c`` (``[b, n]``) exceeds ``x``
    (``[b, 1]``), or, if rounding left none, the last index of nonzero weight."""
    first = torch.searchsorted(c, x, right=True)
    last_nonzero = torch.searchsorted(c, c[:, -1:].contiguous(), right=False)
    return torch.minimum(first, last_nonzero)


def inverse_cdf(w: Tensor, u: Tensor) -> Tensor:
    """Per row, the token whose interval of the running sum of ``w`` holds ``u`` times the
    total: a draw from ``w / sum(w)`` given ``u ~ U[0, 1)``; a token of weight 0 is never
    chosen. Two levels, so the float64 running sum covers ``V / 256 + 256`` values per
    row, not ``V`` (a float64 ``cumsum`` of ``[32, 32000]`` cost about as much as the
    exponential noise it replaced): the block sums (float64) choose a block, then the
    running sum inside it the token.

    Args:
        w: ``[b, V]`` nonnegative weights, each row with a positive one.
        u: float64 ``[b]`` in ``[0, 1)``.

    Returns:
        long ``[b]``.
    """
    b, vocab = w.shape
    nb = -(-vocab // _BLOCK)
    if nb * _BLOCK != vocab:
        w = torch.nn.functional.pad(w, (0, nb * _BLOCK - vocab))  # zeros: never chosen
    blocks = w.view(b, nb, _BLOCK)
    cs = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # [b, nb]
    x = u[:, None] * cs[:, -1:]  # [b, 1], below the total
    blk = _first_above(cs, x)  # [b, 1], a block of positive weight
    before = torch.where(blk > 0, cs.gather(1, (blk - 1).clamp_min(0)), 0.0)  # [b, 1]
    inside = blocks[torch.arange(b), blk[:, 0]]  # [b, BLOCK]
    c = inside.cumsum(-1, dtype=torch.float64)
    return (blk * _BLOCK + _first_above(c, x - before))[:, 0]


def _prepared(
    logits: Tensor, rows: Sequence[RowSampling], bitmask: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, dict[int, str]]:
    """``(x [B, V], max [B], argmax [B], failed)``: the logits after the grammar masks,
    ``logit_bias``, bans and penalties (steps 2-3), each row's maximum and its first
    index, and the rows that cannot give a token."""
    b, vocab = logits.shape
    if len(rows) != b:
        raise ValueError(f"sample: {b} rows of logits but {len(rows)} row settings")
    x = logits.float()
    writes = any(r.settings.logit_bias or r.banned for r in rows) or (
        bitmask is not None and any(r.bitmask_row is not None for r in rows)
    )
    if writes and x is logits:  # masks and bans write in place: never into the caller's
        x = x.clone()
    if bitmask is not None:
        masked = [i for i, r in enumerate(rows) if r.bitmask_row is not None]
        if masked:
            which = torch.tensor([rows[i].bitmask_row for i in masked])
            allowed = unpack_bitmask(bitmask[which], vocab)  # [m, V]
            x[masked] = x[masked].masked_fill(~allowed, float("-inf"))
    _bias_and_ban(x, rows)
    x = _penalise(x, rows)
    # [B] each; NaN and +inf propagate, an all -inf row stays -inf; the indices are the
    # greedy rows' tokens (the first maximum, as argmax; one pass, where amax then argmax
    # read the logits twice, and CPU argmax is several times slower than max)
    top, tokens = x.max(dim=-1)
    bad = (~torch.isfinite(top)).tolist()
    failed = {
        i: (
            "no token can be chosen: the logits hold NaN or +inf"
            if math.isnan(v) or v > 0
            else "no token can be chosen: every token is masked (grammar, logit_bias or min_tokens)"
        )
        for i, (v, is_bad) in enumerate(zip(top.tolist(), bad, strict=True))
        if is_bad
    }
    return x, top, tokens, failed


def token_logprobs(
    logits: Tensor, rows: Sequence[RowSampling], tokens: Sequence[int], failed: Mapping[int, str]
) -> list[tuple[float, list[tuple[int, float]]] | None]:
    """Per row, ``(logprob of tokens[i], [(token, logprob)] of the top ones)`` from the
    model's logits as they are (step 1) when the row asks for logprobs, else None."""
    want, logp, top_vals, top_idx = _raw_logprobs(logits, rows)
    lps: list[tuple[float, list[tuple[int, float]]] | None] = [None] * len(rows)
    if logp is None:
        return lps
    for j, i in enumerate(want):
        if i in failed:
            continue
        k = int(rows[i].settings.logprobs or 0)
        top_pairs: list[tuple[int, float]] = []
        if k and top_idx is not None and top_vals is not None:
            top_pairs = list(zip(top_idx[j, :k].tolist(), top_vals[j, :k].tolist(), strict=True))
        lps[i] = (float(logp[j, tokens[i]]), top_pairs)
    return lps


def sample(
    logits: Tensor,
    rows: Sequence[RowSampling],
    *,
    bitmask: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> SampleOutput:
    """Choose one token for each row of a step.

    Args:
        logits: ``[B, V]`` the step's logits, one row per :class:`RowSampling`.
        rows: the rows' settings and state.
        bitmask: ``[M, ceil(V/32)]`` int32 grammar masks; row ``i`` of the step uses mask
            row ``rows[i].bitmask_row`` (rows without one are unconstrained).
        generator: draws the noise of rows without their own generator.

    Returns:
        The tokens, the requested log-probabilities and the rows that failed.
    """
    x, top, tokens, failed = _prepared(logits, rows, bitmask)
    sampled = [i for i, r in enumerate(rows) if not r.settings.greedy and i not in failed]
    if sampled:
        tokens[sampled] = _draw(x, top, rows, sampled, generator)
    out = tokens.tolist()
    for i in failed:
        out[i] = -1
    lps = token_logprobs(logits, rows, out, failed)
    return SampleOutput(out, lps, failed)


def sampling_probs(
    logits: Tensor, rows: Sequence[RowSampling], *, bitmask: Tensor | None = None
) -> tuple[Tensor, dict[int, str]]:
    """The distribution :func:`sample` draws each row's token from, for speculative
    sampling with a draft model (the rejection rule needs the target's and the draft's
    probabilities after every setting of the row).

    Returns:
        ``(probs [B, V] float32, failed)``: a greedy row is one-hot at its argmax, a
        sampled row is the softmax of its logits after steps 2-4 (masks, bias, bans,
        penalties, temperature, min-p, top-k, top-p); a failed row is all zeros.
    """
    x, _, tokens, failed = _prepared(logits, rows, bitmask)
    probs = torch.zeros_like(x)
    greedy = [i for i, r in enumerate(rows) if r.settings.greedy and i not in failed]
    if greedy:
        idx = torch.tensor(greedy)
        probs[idx, tokens[idx]] = 1.0
    sampled = [i for i, r in enumerate(rows) if not r.settings.greedy and i not in failed]
    if sampled:
        sub = [rows[i] for i in sampled]
        temps = torch.tensor([r.settings.temperature for r in sub])
        probs[sampled] = torch.softmax(_filtered(x[sampled] / temps[:, None], sub), dim=-1)
    return probs, failed


def _filtered(z: Tensor, rows: Sequence[RowSampling]) -> Tensor:
    """``z [b, V]`` (logits over temperature) filtered by the rows' min-p, top-k, top-p."""
    min_p = _column(rows, "min_p", 0.0)
    if min_p is not None:
        z = min_p_filter(z, min_p)
    top_k = _column(rows, "top_k", 0.0)
    if top_k is not None:
        z = top_k_filter(z, top_k.long())
    top_p = _column(rows, "top_p", 1.0)
    if top_p is not None:
        z = top_p_filter(z, top_p)
    return z


# ----------------------------------------------------------------- speculative verification


def speculative_verify(
    target_probs: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None = None,
    *,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Accept a prefix of drafted tokens so the output is distributed as the target's.

    The rejection rule of speculative sampling (Leviathan et al., 2023; Chen et al.,
    2023): draft token ``d_i`` is kept with probability ``min(1, p_i(d_i) / q_i(d_i))``;
    at the first rejection the next token is drawn from ``max(p_i - q_i, 0)``
    renormalised, and when every draft is kept one more token is drawn from
    ``p_k``. A deterministic draft (prompt lookup) has ``q_i`` one-hot at ``d_i``: it is
    kept with probability ``p_i(d_i)`` and a rejection draws from ``p_i`` without ``d_i``.

    Args:
        target_probs: ``[k + 1, V]``, the target's sampling distributions (after
            temperature and filters) after the context and after each draft token.
        draft_tokens: long ``[k]``.
        draft_probs: ``[k, V]``, the draft's distributions the tokens were drawn from,
            or None for a deterministic draft.
        generator: the random generator.

    Returns:
        ``(accepted, next_token)``: how many drafts are kept, and the token after them.

    Raises:
        ValueError: shapes that do not fit together.
    """
    k = draft_tokens.shape[0]
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(
            f"target_probs must be [{k + 1}, V] for {k} draft tokens, got "
            f"{tuple(target_probs.shape)}"
        )
    if draft_probs is not None and tuple(draft_probs.shape) != (k, target_probs.shape[1]):
        raise ValueError(
            f"draft_probs must be [{k}, {target_probs.shape[1]}], got {tuple(draft_probs.shape)}"
        )
    p = target_probs.double()
    idx = torch.arange(k, device=p.device)
    p_d = p[idx, draft_tokens]  # [k]
    q_d = torch.ones_like(p_d) if draft_probs is None else draft_probs.double()[idx, draft_tokens]
    u = torch.rand(k, generator=generator, dtype=torch.float64, device=p.device)
    keep = (u * q_d < p_d).tolist()  # u < p/q, without dividing by q = 0
    accepted = next((i for i, ok in enumerate(keep) if not ok), k)
    if accepted == k:
        dist = p[k]
    else:
        if draft_probs is None:
            dist = p[accepted].clone()
            dist[draft_tokens[accepted]] = 0.0
        else:
            dist = (p[accepted] - draft_probs.double()[accepted]).clamp_min(0.0)
        if float(dist.sum()) <= 0.0:  # p == q exactly: the rejection had probability 0
            dist = p[accepted]
    token = int(torch.multinomial(dist / dist.sum(), 1, generator=generator))
    return accepted, token
