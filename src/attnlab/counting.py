"""Closed-form counting: attended pairs and the pairs a tiled kernel computes, for any length.

The cost model asks how many (query, key) pairs a pattern keeps, and how many a kernel
that skips empty ``block_q x block_k`` tiles computes, at lengths no tensor could hold
(``10**12`` tokens). Everything here is exact integer arithmetic on Python ints:

* a *band* ``-right <= q - k <= left`` (causal, sliding windows, ``full``, and their
  intersections) keeps, for each query position, a count that is piecewise affine in
  the position; :func:`sum_clamped` sums such a function piece by piece as arithmetic
  series, so :func:`band_pairs` is ``O(1)`` in the lengths;
* a dilated window is summed over its ``2w + 1`` diagonals, each an interval overlap,
  again piecewise affine (in the diagonal index): ``O(1)``;
* the pairs of a tiled kernel need ``sum_i floor((a i + b) / m)``, which
  :func:`floor_sum` computes in ``O(log m)`` steps (the Euclid-like recursion for sums of
  floors of a linear function, as in Graham, Knuth and Patashnik, "Concrete
  Mathematics", sec. 3.5);
* patterns that carry data (documents, global tokens, padding) are counted in the size
  of that data (segments, indices, rows), whatever the sequence length.

Lengths past int64 are refused by the patterns' length checks. The module imports no
torch (it sits outside ``functional/``, whose package imports torch), so that ``attnlab
estimate`` answers without loading torch; the patterns of
:mod:`attnlab.functional.masks` count through it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

__all__ = [
    "INT64_MAX",
    "band_pairs",
    "band_tile_pairs",
    "dilated_pairs",
    "floor_sum",
    "sum_clamped",
]

#: The largest length (and count) the library accepts: what a long tensor index holds.
INT64_MAX = (1 << 63) - 1
#: "Unbounded" for a side of a band (causal's left): beyond any int64 position.
FAR = 1 << 64


def _ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


def sum_clamped(g: Callable[[int], int], lo: int, hi: int, cuts: Iterable[int]) -> int:
    """``sum_{x=lo}^{hi} max(0, g(x))`` for an integer ``g`` that is affine between cuts.

    ``cuts`` are the first points of new affine pieces (extra cuts are harmless). Within
    a piece, the zero crossing of ``g`` is found exactly with integer division, and each
    positive stretch is an arithmetic series.
    """
    if hi < lo:
        return 0
    points = sorted({lo, hi + 1, *(c for c in cuts if lo < c <= hi)})
    total = 0
    for a, b_end in itertools.pairwise(points):
        b = b_end - 1
        ga, gb = g(a), g(b)
        if ga <= 0 and gb <= 0:
            continue
        if ga < 0 or gb < 0:  # one crossing inside the piece: keep the positive side
            slope = (gb - ga) // (b - a)  # exact: g is affine with an integer slope here
            if ga < 0:
                a += _ceil_div(-ga, slope)
            else:
                b = a + ga // (-slope)
            ga, gb = g(a), g(b)
        total += (ga + gb) * (b - a + 1) // 2
    return total


def band_pairs(left: int, right: int, q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> int:
    """Pairs with query ``q`` in ``[q_lo, q_hi]``, key ``k`` in ``[k_lo, k_hi]``, ``-right <= q - k <= left``.

    ``O(1)``: per query the count ``min(q + right, k_hi) - max(q - left, k_lo) + 1`` is
    affine between ``k_hi - right + 1`` and ``k_lo + left + 1``.
    """
    if q_hi < q_lo or k_hi < k_lo:
        return 0

    def seen(q: int) -> int:
        return min(q + right, k_hi) - max(q - left, k_lo) + 1

    return sum_clamped(seen, q_lo, q_hi, (k_hi - right + 1, k_lo + left + 1))


def dilated_pairs(
    window: int, dilation: int, causal: bool, q_lo: int, q_hi: int, kv_len: int
) -> int:
    """Pairs of a dilated window: ``q - k = j * dilation`` for ``j`` in ``[-window or 0, window]``.

    Summed over the diagonals ``j``: the queries of diagonal ``j`` are the overlap of
    ``[j d, j d + S - 1]`` with ``[q_lo, q_hi]``, affine in ``j`` between two cuts.
    """
    if q_hi < q_lo or kv_len <= 0:
        return 0
    d = dilation

    def overlap(j: int) -> int:
        return min(j * d + kv_len - 1, q_hi) - max(j * d, q_lo) + 1

    cuts = ((q_hi - kv_len + 1) // d + 1, q_lo // d + 1)
    return sum_clamped(overlap, 0 if causal else -window, window, cuts)


def floor_sum(n: int, m: int, a: int, b: int) -> int:
    """``sum_{i=0}^{n-1} floor((a * i + b) / m)`` for ``n >= 0``, ``m >= 1``, in ``O(log m)``."""
    total = 0
    while n > 0:
        if a >= m or a < 0:
            total += n * (n - 1) // 2 * (a // m)
            a %= m
        if b >= m or b < 0:
            total += n * (b // m)
            b %= m
        top = a * n + b
        if top < m:
            break
        n, b, m, a = top // m, top % m, a, m
    return total


def _first_at_least(step: int, start: int, target: int) -> int:
    """Smallest ``i >= 0`` with ``start + step * i >= target`` (``step > 0``)."""
    return max(0, _ceil_div(target - start, step))


def band_tile_pairs(
    left: int, right: int, q_offset: int, q_len: int, kv_len: int, block_q: int, block_k: int
) -> int:
    """Pairs a kernel with ``block_q x block_k`` tiles computes for a band, in closed form.

    Queries sit at ``q_offset .. q_offset + L - 1``, keys at ``0 .. S - 1``. Query tile
    ``i`` needs the keys ``lo_i = max(0, first_i - left) .. hi_i = min(last_i + right,
    S - 1)`` and computes every key tile between them whole:
    ``rows_i * (min(S, bk * (floor(hi_i / bk) + 1)) - bk * floor(lo_i / bk))``. Each clamp
    switches once as ``i`` grows, so the full tiles split into ``O(1)`` runs whose floors
    :func:`floor_sum` adds up; the ragged last tile is counted on its own.
    """
    if q_len <= 0 or kv_len <= 0:
        return 0
    bq, bk, S = block_q, block_k, kv_len

    def tile(first: int, last: int) -> int:
        lo, hi = max(0, first - left), min(last + right, S - 1)
        if hi < 0 or lo > S - 1 or lo > hi:
            return 0
        return min(S, bk * (hi // bk + 1)) - bk * (lo // bk)

    n_full = q_len // bq
    total = 0
    if q_len % bq:
        first = q_offset + n_full * bq
        total += (q_len - n_full * bq) * tile(first, q_offset + q_len - 1)
    # full tiles i in [0, n_full): first = o + bq i, last = o + bq i + bq - 1
    o = q_offset
    starts = {
        0,
        n_full,
        min(n_full, _first_at_least(bq, o - left, 0)),  # lo no longer clamped to 0
        min(n_full, _first_at_least(bq, o + bq - 1 + right, S - 1)),  # hi clamped to S - 1
        # k1 = S once hi reaches the last key tile
        min(n_full, _first_at_least(bq, o + bq - 1 + right, bk * (_ceil_div(S, bk) - 1))),
        min(n_full, _first_at_least(bq, o - left, S)),  # lo past the keys: empty
        min(n_full, _first_at_least(bq, o + bq - 1 + right, 0)),  # hi >= 0
    }
    for a, b in itertools.pairwise(sorted(starts)):
        if b <= a:
            continue
        fa, la = o + bq * a, o + bq * a + bq - 1
        if tile(fa, la) == 0 and tile(o + bq * (b - 1), o + bq * (b - 1) + bq - 1) == 0:
            continue
        n = b - a
        lo_clamped = fa - left < 0
        hi_clamped = la + right >= S - 1
        k1_is_s = hi_clamped or min(S, bk * ((la + right) // bk + 1)) == S
        # k1 = S, or bk * (floor((la + right + bq j) / bk) + 1) for j = 0..n-1
        k1_sum = S * n if k1_is_s else bk * (floor_sum(n, bk, bq, la + right) + n)
        k0_sum = 0 if lo_clamped else bk * floor_sum(n, bk, bq, fa - left)
        total += bq * (k1_sum - k0_sum)
    return total
