"""The pattern algebra: :class:`MaskPattern`, its evaluation, ``&``, ``|``, ``~`` and score modifiers.

A pattern is a predicate on (query position, key position) pairs, in the spirit of
FlexAttention's ``mask_mod`` (He et al., 2024). :meth:`MaskPattern.evaluate` is the one
function that evaluates it; ``to_dense``, the tile geometry and every backend use it.
Counting (:meth:`MaskPattern.count`, :meth:`MaskPattern.density`,
:meth:`MaskPattern.tile_pairs`) is in closed form where the pattern has one
(:mod:`attnlab.counting`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from attnlab import counting
from attnlab.functional.masks.dense import _check_len
from attnlab.functional.masks.geometry import (
    _BlockRanges,
    _positions_for,
    default_positions,
    reduce_tiles,
)
from attnlab.functional.score_mods import ScoreMod

__all__ = ["MaskMod", "MaskPattern"]

# A mask_mod takes broadcastable index tensors (batch, head, query pos, key pos)
# and returns a bool tensor: True = attend.
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


class MaskPattern:
    """A structured attention pattern: which (query position, key position) pairs attend.

    Subclasses implement :meth:`mask_mod`. Patterns are immutable values that
    combine with ``&``, ``|`` and ``~``.
    """

    #: True when the pattern differs between sequences of a batch (padding, documents).
    batch_dependent: bool = False
    #: Score modifiers applied before the mask (see :meth:`with_scores`).
    score_mods: tuple[ScoreMod, ...] = ()

    def with_scores(self, *mods: ScoreMod) -> MaskPattern:
        """This pattern with score modifiers (ALiBi, soft-capping) applied before the mask.

        ``masks.causal().with_scores(alibi(12), softcap(50.0))``. Backends that cannot
        apply them say so in their check; ``reference``, ``tiled``, ``sparse`` and
        ``flex`` apply them on the fly.

        Raises:
            TypeError: something that is not a :class:`~attnlab.functional.score_mods.ScoreMod`.
        """
        for m in mods:
            if not isinstance(m, ScoreMod):
                raise TypeError(f"with_scores takes ScoreMod objects, got {type(m).__name__}")
        from attnlab.functional.masks.combinators import Scored

        return Scored(self, (*self.score_mods, *mods))

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        """Return a bool tensor (broadcast of the inputs), True where ``q_idx`` attends ``kv_idx``."""
        raise NotImplementedError

    def structure(self) -> tuple[object, ...]:
        """A hashable key of the pattern's structure (kind and parameters, not its data).

        What ``auto`` memoizes its choice on: two padding patterns of one batch size
        share a structure, whatever their masks.
        """
        key: tuple[object, ...] | None = self.__dict__.get("_structure")
        if key is None:
            key = self._structure()
            self.__dict__["_structure"] = key
        return key

    def _structure(self) -> tuple[object, ...]:
        return (type(self).__name__, self.batch_size, *self._params())

    def _params(self) -> tuple[object, ...]:
        """The parameters that define the pattern (window sizes, ...), for :meth:`structure`."""
        return ()

    def check_fits(self, q_end: int, k_end: int) -> None:
        """Refuse a call whose positions the pattern's data does not cover.

        A pattern that carries per-position data (document ids, a padding mask, global
        token indices) must cover every position of the call: queries at ``< q_end``,
        keys at ``< k_end``. (Data longer than the call is fine: a padding mask over
        every slot of a cache, of which a call sees some.)

        Raises:
            ValueError: naming the pattern, its length and the call's.
        """
        for leaf in self._leaves():
            leaf._check_fits(q_end, k_end)

    def _leaves(self) -> tuple[MaskPattern, ...]:
        return (self,)

    def _check_fits(self, q_end: int, k_end: int) -> None:
        return None

    @property
    def batch_size(self) -> int | None:
        """Batch size a batch-dependent pattern was built for (None otherwise)."""
        return None

    def evaluate(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The pattern on (query position, key position) pairs: the one evaluation function.

        ``to_dense``, the tile geometry of :meth:`block_mask` and every backend's
        element mask call this. A key at position ``-1`` is an empty entry (a cache
        slot not written yet, a hole of a paged block) and is never attended,
        whatever the pattern says.

        Args:
            q_pos: long ``[P, *, L]``, the position (slot) of each query; ``P`` is 1 or the batch.
            k_pos: long ``[P, *, S]``, the position of each key, ``-1`` for empty.
                ``*`` are optional extra dims shared with ``q_pos`` (gathered blocks).

        Returns:
            Bool ``[P', 1, *, L, S]``, True = attend; ``P'`` is the batch when the
            positions or the pattern are per sequence, else 1.

        Raises:
            ValueError: positions for a batch other than the pattern's.
        """
        q = q_pos.unsqueeze(-1).unsqueeze(1)  # [P, 1, *, L, 1]
        k = k_pos.unsqueeze(-2).unsqueeze(1)  # [P, 1, *, 1, S]
        rows = max(q_pos.shape[0], k_pos.shape[0])
        if self.batch_dependent:
            n = self.batch_size or 1
            if rows not in (1, n):
                raise ValueError(
                    f"pattern {self!r} was built for batch size {n}, but the positions "
                    f"have {rows} rows"
                )
            rows = n
        dev = q_pos.device
        zero = torch.zeros((), dtype=torch.long, device=dev)
        b = zero if rows == 1 else torch.arange(rows, device=dev).view(-1, *([1] * (q.dim() - 1)))
        out = self.mask_mod(b, zero, q, k) & (k >= 0)
        return out.expand(rows, 1, *torch.broadcast_shapes(q.shape[2:], k.shape[2:]))

    def to_dense(
        self,
        q_len: int,
        kv_len: int | None = None,
        *,
        q_offset: int = 0,
        device: torch.device | str | None = None,
        q_positions: Tensor | None = None,
        k_positions: Tensor | None = None,
    ) -> Tensor:
        """Materialise the pattern.

        Args:
            q_len: number of queries ``L``.
            kv_len: number of keys ``S`` (default ``q_len``).
            q_offset: absolute position of the first query (see the module docstring),
                when ``q_positions`` is not given.
            device: where to build the mask.
            q_positions: long ``[P, L]`` query positions (default ``q_offset + arange(L)``).
            k_positions: long ``[P, S]`` key positions, ``-1`` empty (default ``arange(S)``).

        Returns:
            Bool tensor ``(L, S)``, or ``(P, 1, L, S)`` for a batch-dependent pattern or
            per-row positions.
        """
        kv_len = q_len if kv_len is None else kv_len
        _check_len("q_len", q_len)
        _check_len("kv_len", kv_len)
        dev = device if device is not None else self._device()
        qp, kp = _positions_for(q_len, kv_len, q_offset, dev, q_positions, k_positions)
        out = self.evaluate(qp, kp)  # [P, 1, L, S]
        if out.shape[0] == 1 and not self.batch_dependent:
            return out[0, 0]
        return out

    def count(self, q_len: int, kv_len: int | None = None, *, q_offset: int = 0) -> int:
        """Attended (query, key) pairs, exactly, for queries at ``q_offset ..`` and keys at ``0 .. S-1``.

        Summed over the sequences of a batch-dependent pattern. In closed form (exact
        integers, any length up to int64, a few microseconds) for the patterns, their
        intersections with windows, complements, and a window with global tokens;
        anything else is evaluated, in row chunks, up to ``2**26`` pairs.

        Raises:
            ValueError: a length past int64, or a pattern with no closed form past
                ``2**26`` pairs.
        """
        kv_len = q_len if kv_len is None else kv_len
        _check_len("q_len", q_len)
        _check_len("kv_len", kv_len)
        if q_len == 0 or kv_len == 0:
            return 0
        exact = self._count(q_offset, q_offset + q_len - 1, kv_len)
        if exact is not None:
            return exact
        n = (self.batch_size or 1) if self.batch_dependent else 1
        if n * q_len * kv_len > (1 << 26):
            raise ValueError(
                f"{self!r} has no closed-form count; evaluating it at q_len={q_len}, "
                f"kv_len={kv_len} would take {n * q_len * kv_len} pairs (limit 2**26)"
            )
        return self._evaluate_count(torch.arange(q_len) + q_offset, kv_len)

    def _evaluate_count(self, rows: Tensor, kv_len: int) -> int:
        """Attended pairs of the query positions ``rows`` ``[R]`` over keys ``0..S-1``, evaluated."""
        keys = default_positions(kv_len)
        chunk = max(1, (1 << 22) // kv_len)
        total = 0
        for start in range(0, rows.numel(), chunk):
            total += int(self.evaluate(rows[start : start + chunk].view(1, -1), keys).sum())
        return total

    def density(self, q_len: int, kv_len: int | None = None, *, q_offset: int = 0) -> float:
        """Fraction of (query, key) pairs attended.

        Exact where :meth:`count` has a closed form (any length) or the pattern is
        small enough to evaluate (``2**26`` pairs); otherwise estimated from a
        ``4096 x 4096`` grid of evenly spaced query and key positions (the cost model
        needs a fraction, not a count), in constant time.
        """
        kv_len = q_len if kv_len is None else kv_len
        _check_len("q_len", q_len)
        _check_len("kv_len", kv_len)
        if q_len == 0 or kv_len == 0:
            return 0.0
        n = (self.batch_size or 1) if self.batch_dependent else 1
        exact = self._count(q_offset, q_offset + q_len - 1, kv_len)
        if exact is None and n * q_len * kv_len <= (1 << 26):
            exact = self._evaluate_count(torch.arange(q_len) + q_offset, kv_len)
        if exact is not None:
            return exact / (n * q_len * kv_len)
        rows = torch.linspace(0, q_len - 1, 4096, dtype=torch.float64).round().long().unique()
        keys = torch.linspace(0, kv_len - 1, 4096, dtype=torch.float64).round().long().unique()
        hits = self.evaluate((rows + q_offset).view(1, -1), keys.view(1, -1)).sum()
        return int(hits) / (n * rows.numel() * keys.numel())

    def tile_pairs(
        self, q_len: int, kv_len: int, block_q: int, block_k: int, *, q_offset: int = 0
    ) -> int:
        """Pairs per head a kernel with ``block_q x block_k`` tiles computes (tiles it cannot skip).

        In closed form for windows, causal, dilated windows and their intersections
        (:func:`~attnlab.counting.band_tile_pairs`, any length); from
        :meth:`block_mask` otherwise.
        """
        for name, n in (("q_len", q_len), ("kv_len", kv_len)):
            _check_len(name, n)
        for name, n in (("block_q", block_q), ("block_k", block_k)):
            _check_len(name, n, min_value=1)
        band = self._tile_band()
        if band is not None:
            return counting.band_tile_pairs(*band, q_offset, q_len, kv_len, block_q, block_k)
        if q_len == 0 or kv_len == 0:
            return 0
        needed, _ = self.block_mask(q_len, kv_len, block_q, block_k, q_offset=q_offset)
        rows = torch.full((needed.shape[0],), block_q, dtype=torch.long)
        rows[-1] = q_len - block_q * (needed.shape[0] - 1)
        cols = torch.full((needed.shape[1],), block_k, dtype=torch.long)
        cols[-1] = kv_len - block_k * (needed.shape[1] - 1)
        return int(rows @ needed.long() @ cols)

    def _band(self) -> tuple[int, int] | None:
        """``(left, right)`` when the pattern is exactly ``-right <= q - k <= left``, else None."""
        return None

    def _tile_band(self) -> tuple[int, int] | None:
        """The band whose tiles :meth:`block_mask` marks as needed, when there is one."""
        return self._band()

    def _count(self, q_lo: int, q_hi: int, kv_len: int) -> int | None:
        """Closed-form count for queries at ``q_lo..q_hi`` and keys ``0..kv_len-1``, or None."""
        band = self._band()
        if band is None:
            return None
        return counting.band_pairs(*band, q_lo, q_hi, 0, kv_len - 1)

    def _count_in_band(
        self, left: int, right: int, q_lo: int, q_hi: int, kv_len: int
    ) -> int | None:
        """Closed-form count of ``self & band(left, right)``, or None."""
        return None

    def _count_or_band(
        self, left: int, right: int, q_lo: int, q_hi: int, kv_len: int
    ) -> int | None:
        """Closed-form count of ``self | band(left, right)``, or None."""
        return None

    def _unscored(self) -> MaskPattern:
        return self

    def block_mask(
        self,
        q_len: int,
        kv_len: int,
        block_q: int,
        block_k: int,
        *,
        q_offset: int = 0,
        device: torch.device | str | None = None,
        q_positions: Tensor | None = None,
        k_positions: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Which ``block_q x block_k`` tiles of the ``L x S`` score matrix the pattern touches.

        This is what block-sparse kernels (FlashAttention's block skipping, Longformer-
        and BigBird-style sparse attention, FlexAttention's ``BlockMask``) need to
        know: a tile with no attended pair is skipped, and a tile whose pairs are all
        attended needs no element mask. The tiles are described by the positions they
        hold (the smallest and largest query and key position), so the same closed
        forms serve contiguous prefill, cached decoding and per-row slots with holes;
        they cost ``O(L/block_q * S/block_k)``. A pattern without one is evaluated in
        row chunks.

        Args:
            q_len: number of queries ``L``.
            kv_len: number of keys ``S``.
            block_q: rows per tile (the last tile may be shorter).
            block_k: keys per tile (the last tile may be shorter).
            q_offset: absolute position of the first query, when ``q_positions`` is not given.
            device: where to build the result.
            q_positions: long ``[P, L]`` query positions (default ``q_offset + arange(L)``).
            k_positions: long ``[P, S]`` key positions, ``-1`` empty (default ``arange(S)``).

        Returns:
            ``(any_, all_)``: bool ``[ceil(L/block_q), ceil(S/block_k)]``. ``any_`` is True
            where the tile may hold an attended pair (a superset of the truth, exact for
            the built-in patterns except dilated windows and combinations); ``all_`` is
            True only where every pair of the tile is attended (a subset). Per-row
            positions and batch-dependent patterns are reduced over the batch (``any`` of
            ``any_``, ``all`` of ``all_``).
        """
        for name, n in (("q_len", q_len), ("kv_len", kv_len)):
            _check_len(name, n)
        for name, n in (("block_q", block_q), ("block_k", block_k)):
            _check_len(name, n, min_value=1)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        qp, kp = _positions_for(q_len, kv_len, q_offset, dev, q_positions, k_positions)
        r = _BlockRanges(qp.to(dev), kp.to(dev), block_q, block_k)
        any_, all_ = self._block_mask(r)
        any_, all_ = any_ & r.k_any, all_ & r.k_all
        shape = torch.broadcast_shapes(any_.shape, all_.shape, (r.nq, r.nk))
        any_, all_ = any_.expand(shape), all_.expand(shape)
        while any_.dim() > 2:  # per sequence: a tile is needed if any sequence needs it
            any_, all_ = any_.any(0), all_.all(0)
        return any_.contiguous(), all_.contiguous()

    def _block_mask(self, r: _BlockRanges) -> tuple[Tensor, Tensor]:
        """Fallback: evaluate the pattern in chunks of query tiles and reduce."""
        nq, nk = r.nq, r.nk
        rows = max(r.q_pos.shape[0], r.k_pos.shape[0])
        if self.batch_dependent:
            rows = self.batch_size or 1
        any_ = torch.zeros(rows, nq, nk, dtype=torch.bool, device=r.device)
        all_ = torch.zeros(rows, nq, nk, dtype=torch.bool, device=r.device)
        tiles_per_chunk = max(1, (1 << 22) // max(r.kv_len * r.block_q, 1))
        for t0 in range(0, nq, tiles_per_chunk):
            t1 = min(nq, t0 + tiles_per_chunk)
            rows0, rows1 = t0 * r.block_q, min(t1 * r.block_q, r.q_len)
            dense = self.evaluate(r.q_pos[:, rows0:rows1], r.k_pos)[:, 0]  # [P, R, S]
            dense = dense.transpose(-1, -2)  # [P, S, R]
            tq = t1 - t0
            for dst, op in ((any_, "any"), (all_, "all")):
                x = reduce_tiles(dense, r.block_q, tq, op).transpose(-1, -2)  # [P, tq, S]
                dst[:, t0:t1] = reduce_tiles(x, r.block_k, nk, op)
        return any_, all_

    def _device(self) -> torch.device | None:
        return None

    # The combinators subclass MaskPattern, so they live in a module that imports this one.

    def __and__(self, other: MaskPattern) -> MaskPattern:
        from attnlab.functional.masks.combinators import Combined, as_pattern

        return Combined("&", (self, as_pattern(other)))

    def __or__(self, other: MaskPattern) -> MaskPattern:
        from attnlab.functional.masks.combinators import Combined, as_pattern

        return Combined("|", (self, as_pattern(other)))

    def __invert__(self) -> MaskPattern:
        from attnlab.functional.masks.combinators import Not

        return Not(self)
