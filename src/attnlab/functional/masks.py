"""Attention masks: dense helpers and structured patterns.

Conventions (the same as ``torch.nn.functional.scaled_dot_product_attention``):
a boolean mask is ``True`` where a query may attend to a key; a floating mask is
added to the scores. Dense masks broadcast to the scores' shape ``(B, H, L, S)``
(``L`` query length, ``S`` key length).

Two kinds of objects live here:

* dense helpers that return tensors: :func:`causal_mask`, :func:`padding_mask`,
  :func:`lengths_mask`, :func:`combine`;
* structured patterns (:class:`MaskPattern`): :func:`causal`, :func:`sliding_window`,
  :func:`global_tokens`, :func:`dilated`, :func:`document`, :func:`prefix_lm`,
  :func:`padding`. A pattern is a predicate on absolute positions, in the spirit of
  FlexAttention's ``mask_mod``; patterns combine with ``&``, ``|`` and ``~``, are
  accepted as ``attn_mask=`` by every attention entry point, and can be made
  dense with :meth:`MaskPattern.to_dense` for tests and pictures. Backends that
  understand a pattern skip the blocks it masks out instead of building ``L x S``.

Positions: a pattern is a predicate on (query position, key position) pairs, where
a position is a token's slot in its row's sequence (left padding included). The
attention call says where its queries and keys sit (``q_positions`` ``[B|1, L]``,
``k_positions`` ``[B|1, S]``, ``-1`` for an empty key, see ``docs/contracts.md``);
:meth:`MaskPattern.evaluate` is the one function that evaluates a pattern on them,
used by ``to_dense``, by the tile geometry of :meth:`MaskPattern.block_mask` and by
every backend. Without positions, queries sit at ``q_offset + i`` and keys at ``j``:
``q_offset=0`` is torch's top-left alignment; cached decoding, where the ``L`` new
queries are the last ``L`` of ``S`` keys, uses ``q_offset = S - L`` (bottom-right
alignment, as FlashAttention >= 2.1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from attnlab.functional._checks import check_tensor
from attnlab.functional.score_mods import ScoreMod

__all__ = [
    "MaskPattern",
    "causal",
    "causal_mask",
    "combine",
    "default_positions",
    "dilated",
    "document",
    "full",
    "global_tokens",
    "lengths_mask",
    "padding",
    "padding_mask",
    "prefix_lm",
    "sliding_window",
]

# A mask_mod takes broadcastable index tensors (batch, head, query pos, key pos)
# and returns a bool tensor: True = attend.
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def _check_len(name: str, n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"{name} must be an int, got {type(n).__name__}")
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {n}")
    return n


# --------------------------------------------------------------------------- dense


def causal_mask(
    q_len: int,
    kv_len: int | None = None,
    *,
    offset: int = 0,
    device: torch.device | str | None = None,
) -> Tensor:
    """Dense causal mask of shape ``(q_len, kv_len)``: query ``i`` sees keys ``j <= i + offset``.

    Args:
        q_len: number of queries ``L``.
        kv_len: number of keys ``S`` (default ``q_len``).
        offset: position of the first query among the keys. ``0`` is torch's
            ``is_causal`` (top-left); ``kv_len - q_len`` is the alignment of
            cached decoding (bottom-right).
        device: where to build the mask.

    Returns:
        Bool tensor ``(L, S)``, True = attend.
    """
    kv_len = q_len if kv_len is None else kv_len
    _check_len("q_len", q_len)
    _check_len("kv_len", kv_len)
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"offset must be an int, got {type(offset).__name__}")
    q = torch.arange(q_len, device=device).unsqueeze(-1) + offset  # [L, 1]
    k = torch.arange(kv_len, device=device).unsqueeze(0)  # [1, S]
    return k <= q


def padding_mask(attention_mask: Tensor) -> Tensor:
    """Key-padding mask from a Hugging Face-style ``attention_mask``.

    Args:
        attention_mask: ``(B, S)`` of 1 (token) and 0 (padding), any integer,
            bool or float dtype.

    Returns:
        Bool tensor ``(B, 1, 1, S)``, True at real tokens; broadcasts over heads
        and queries.

    Raises:
        TypeError: not a tensor.
        ValueError: not 2-D, or values other than 0 and 1.
    """
    check_tensor("attention_mask", attention_mask)
    if attention_mask.dim() != 2:
        raise ValueError(
            f"attention_mask must be (batch, seq_len) of 1/0, got shape "
            f"{tuple(attention_mask.shape)}"
        )
    if attention_mask.dtype != torch.bool:
        bad = (attention_mask != 0) & (attention_mask != 1)
        if bool(bad.any()):
            values = torch.unique(attention_mask[bad])[:5].tolist()
            raise ValueError(
                f"attention_mask must hold only 1 (token) and 0 (padding), found {values}; "
                "an additive float mask goes to attn_mask instead"
            )
    return attention_mask.bool()[:, None, None, :]


def lengths_mask(lengths: Tensor | Sequence[int], max_len: int | None = None) -> Tensor:
    """Key-padding mask from sequence lengths (right padding).

    Args:
        lengths: ``(B,)`` number of real tokens per sequence.
        max_len: padded length ``S`` (default: the largest length).

    Returns:
        Bool tensor ``(B, 1, 1, S)``, True at the first ``lengths[b]`` positions.
    """
    lens = torch.as_tensor(lengths)
    if lens.dim() != 1 or lens.dtype.is_floating_point or lens.dtype == torch.bool:
        raise ValueError(
            f"lengths must be a 1-D integer sequence, got {lens.dtype} {tuple(lens.shape)}"
        )
    if lens.numel() and int(lens.min()) < 0:
        raise ValueError(f"lengths must be >= 0, got {lens.tolist()}")
    longest = int(lens.max()) if lens.numel() else 0
    max_len = longest if max_len is None else _check_len("max_len", max_len)
    if longest > max_len:
        raise ValueError(f"a length ({longest}) exceeds max_len ({max_len})")
    pos = torch.arange(max_len, device=lens.device)
    return (pos[None, :] < lens[:, None])[:, None, None, :]


def combine(*masks: Tensor | None) -> Tensor | None:
    """Combine dense masks, broadcasting their shapes.

    Bool masks are intersected (a pair is attended only if every mask allows it).
    If any mask is floating, the result is additive: bool masks become ``0``/``-inf``
    and all are summed. ``None`` entries are skipped; all ``None`` gives ``None``.
    """
    present = [check_tensor("mask", m) for m in masks if m is not None]
    if not present:
        return None
    float_masks = [m for m in present if m.dtype.is_floating_point]
    if not float_masks:
        out = present[0]
        for m in present[1:]:
            out = out & m
        return out
    dtype = torch.promote_types(float_masks[0].dtype, torch.float32)
    for m in float_masks[1:]:
        dtype = torch.promote_types(dtype, m.dtype)
    total: Tensor | None = None
    for m in present:
        add = m.to(dtype) if m.dtype.is_floating_point else _bool_to_additive(m, dtype)
        total = add if total is None else total + add
    return total


def _bool_to_additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        ~mask, float("-inf")
    )


# ------------------------------------------------------------------------ patterns

#: A distance beyond any position: the unbounded side of a window (causal's left).
_FAR = 1 << 62
#: Fill of an empty tile's key range (exact as a float, beyond any real position).
_BIG = 1 << 40


def default_positions(
    n: int, *, offset: int = 0, device: torch.device | str | None = None
) -> Tensor:
    """Positions ``offset .. offset+n-1`` as a long ``[1, n]`` (torch's top-left when 0)."""
    return (torch.arange(n, device=device) + offset).view(1, -1)


def _reduce_tiles(x: Tensor, block: int, n_tiles: int, op: str) -> Tensor:
    """Reduce the last dim ``[.., n]`` by tiles of ``block`` to ``[.., n_tiles]``.

    ``op`` is ``"any"``, ``"all"``, ``"min"`` or ``"max"``; the ragged last tile is
    padded with the operation's neutral value.
    """
    pad = n_tiles * block - x.shape[-1]
    if pad:
        fill: bool | int = {"any": False, "all": True, "min": _BIG, "max": -_BIG}[op]
        x = torch.cat([x, x.new_full((*x.shape[:-1], pad), fill)], dim=-1)
    x = x.view(*x.shape[:-1], n_tiles, block)  # [.., n_tiles, block]
    if op == "any":
        return x.any(-1)
    if op == "all":
        return x.all(-1)
    return x.amin(-1) if op == "min" else x.amax(-1)


class _BlockRanges:
    """The tiles of one call's ``L x S`` score matrix, described by the positions they hold.

    Built from query positions ``[P, L]`` and key positions ``[P, S]`` (``P`` is 1 or
    the batch; a key at ``-1`` is an empty entry). Per tile it keeps the smallest and
    largest query position (``q_first``/``q_last``, ``[P, nq, 1]``) and the smallest
    and largest position of its valid keys (``k_first``/``k_last``, ``[P, 1, nk]``),
    and whether any/all of its keys are valid (``k_any``/``k_all``, ``[P, 1, nk]``).
    A pattern's ``_block_mask`` answers for the valid keys only;
    :meth:`MaskPattern.block_mask` intersects with ``k_any``/``k_all``.
    """

    def __init__(self, q_pos: Tensor, k_pos: Tensor, block_q: int, block_k: int) -> None:
        self.q_pos, self.k_pos = q_pos, k_pos  # [P, L], [P, S]
        self.q_len, self.kv_len = q_pos.shape[-1], k_pos.shape[-1]
        self.block_q, self.block_k = block_q, block_k
        self.device = q_pos.device
        self.nq = -(-self.q_len // block_q)
        self.nk = -(-self.kv_len // block_k)
        valid = k_pos >= 0
        self.q_first = self.reduce_q(q_pos, "min").unsqueeze(-1)  # [P, nq, 1]
        self.q_last = self.reduce_q(q_pos, "max").unsqueeze(-1)  # [P, nq, 1]
        big = torch.full_like(k_pos, _BIG)
        self.k_first = self.reduce_k(torch.where(valid, k_pos, big), "min").unsqueeze(-2)
        self.k_last = self.reduce_k(torch.where(valid, k_pos, -big), "max").unsqueeze(-2)
        self.k_any = self.reduce_k(valid, "any").unsqueeze(-2)  # [P, 1, nk]
        self.k_all = self.reduce_k(valid, "all").unsqueeze(-2)  # [P, 1, nk]

    def q_positions(self) -> Tensor:
        return self.q_pos

    def k_positions(self) -> Tensor:
        return self.k_pos

    def reduce_q(self, x: Tensor, op: str) -> Tensor:
        """Reduce a per-query-position ``[.., L]`` to per-tile ``[.., nq]``."""
        return _reduce_tiles(x, self.block_q, self.nq, op)

    def reduce_k(self, x: Tensor, op: str) -> Tensor:
        """Reduce a per-key-position ``[.., S]`` to per-tile ``[.., nk]``."""
        return _reduce_tiles(x, self.block_k, self.nk, op)


def _window_tiles(r: _BlockRanges, left: int, right: int) -> tuple[Tensor, Tensor]:
    """Tiles touched by ``-right <= q - k <= left`` (``left``/``right`` may be huge)."""
    d_min = r.q_first - r.k_last  # [P, nq, nk] smallest q - k in the tile
    d_max = r.q_last - r.k_first  # [P, nq, nk] largest q - k in the tile
    any_ = (d_max >= -right) & (d_min <= left)
    all_ = (d_min >= -right) & (d_max <= left)
    return any_, all_


def _positions_for(
    q_len: int,
    kv_len: int,
    q_offset: int,
    device: torch.device | str | None,
    q_positions: Tensor | None,
    k_positions: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """Query ``[P, L]`` and key ``[P, S]`` positions: the given ones, or contiguous defaults."""
    if q_positions is None:
        q_positions = default_positions(q_len, offset=q_offset, device=device)
    if k_positions is None:
        k_positions = default_positions(kv_len, device=device)
    for name, pos, n in (("q_positions", q_positions, q_len), ("k_positions", k_positions, kv_len)):
        if pos.dim() != 2 or pos.shape[-1] != n:
            raise ValueError(f"{name} must be [B or 1, {n}], got shape {tuple(pos.shape)}")
    return q_positions.long(), k_positions.long()


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
        return _Scored(self, (*self.score_mods, *mods))

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        """Return a bool tensor (broadcast of the inputs), True where ``q_idx`` attends ``kv_idx``."""
        raise NotImplementedError

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

    def density(self, q_len: int, kv_len: int | None = None, *, q_offset: int = 0) -> float:
        """Fraction of (query, key) pairs attended.

        Exact: patterns with a closed form count per row in ``O(L)``; others are
        counted in row chunks when ``L * S <= 2**26``, and estimated from 4096
        evenly spaced rows above that (the cost model needs a fraction, not a count).
        """
        kv_len = q_len if kv_len is None else kv_len
        _check_len("q_len", q_len)
        _check_len("kv_len", kv_len)
        if q_len == 0 or kv_len == 0:
            return 0.0
        counts = self._row_counts(q_len, kv_len, q_offset)
        if counts is not None:
            return float(counts.sum()) / (q_len * kv_len)
        n = (self.batch_size or 1) if self.batch_dependent else 1
        if q_len * kv_len <= (1 << 26):
            rows_at = torch.arange(q_len)
        else:
            rows_at = torch.linspace(0, q_len - 1, 4096).round().long().unique()
        chunk = max(1, (1 << 22) // kv_len)
        keys = default_positions(kv_len)
        total = 0
        for start in range(0, rows_at.numel(), chunk):
            pos = (rows_at[start : start + chunk] + q_offset).view(1, -1)
            total += int(self.evaluate(pos, keys).sum())
        return total / (n * rows_at.numel() * kv_len)

    def _row_counts(self, q_len: int, kv_len: int, q_offset: int) -> Tensor | None:
        """Attended keys per query row in closed form, or None where there is none."""
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
            if _check_len(name, n) < 1:
                raise ValueError(f"{name} must be >= 1, got {n}")
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
                x = _reduce_tiles(dense, r.block_q, tq, op).transpose(-1, -2)  # [P, tq, S]
                dst[:, t0:t1] = _reduce_tiles(x, r.block_k, nk, op)
        return any_, all_

    def _device(self) -> torch.device | None:
        return None

    def __and__(self, other: MaskPattern) -> MaskPattern:
        return _Combined("&", (self, _as_pattern(other)))

    def __or__(self, other: MaskPattern) -> MaskPattern:
        return _Combined("|", (self, _as_pattern(other)))

    def __invert__(self) -> MaskPattern:
        return _Not(self)


def _no_scores(parts: tuple[MaskPattern, ...]) -> None:
    for p in parts:
        if p.score_mods:
            raise ValueError(
                f"combine patterns before adding score modifiers: {p!r} carries "
                f"{list(p.score_mods)}; write (a & b).with_scores(...)"
            )


def _as_pattern(x: object) -> MaskPattern:
    if not isinstance(x, MaskPattern):
        raise TypeError(
            f"patterns combine only with other patterns, got {type(x).__name__}; "
            "use masks.combine() for dense tensors"
        )
    return x


class _Scored(MaskPattern):
    """A pattern carrying score modifiers; the mask itself is the inner pattern's."""

    def __init__(self, inner: MaskPattern, mods: tuple[ScoreMod, ...]) -> None:
        self.inner = inner._unscored()
        self.score_mods = mods
        self.batch_dependent = inner.batch_dependent

    def _unscored(self) -> MaskPattern:
        return self.inner

    @property
    def batch_size(self) -> int | None:
        return self.inner.batch_size

    def _device(self) -> torch.device | None:
        return self.inner._device()

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.inner.mask_mod(b, h, q_idx, kv_idx)

    def _row_counts(self, q_len: int, kv_len: int, q_offset: int) -> Tensor | None:
        return self.inner._row_counts(q_len, kv_len, q_offset)

    def _block_mask(self, r: _BlockRanges) -> tuple[Tensor, Tensor]:
        return self.inner._block_mask(r)

    def __repr__(self) -> str:
        return f"{self.inner!r}.with_scores({', '.join(map(repr, self.score_mods))})"


class _Combined(MaskPattern):
    def __init__(self, op: str, parts: tuple[MaskPattern, ...]) -> None:
        _no_scores(parts)
        sizes = {p.batch_size or 0 for p in parts if p.batch_dependent}
        if len(sizes) > 1:
            raise ValueError(
                f"cannot combine patterns built for different batch sizes {sorted(sizes)}"
            )
        self.op = op
        self.parts = parts
        self.batch_dependent = any(p.batch_dependent for p in parts)
        self._batch = next(iter(sizes)) if sizes else None

    @property
    def batch_size(self) -> int | None:
        return self._batch

    def _device(self) -> torch.device | None:
        for p in self.parts:
            d = p._device()
            if d is not None:
                return d
        return None

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        out = self.parts[0].mask_mod(b, h, q_idx, kv_idx)
        for p in self.parts[1:]:
            m = p.mask_mod(b, h, q_idx, kv_idx)
            out = (out & m) if self.op == "&" else (out | m)
        return out

    def _block_mask(self, r: _BlockRanges) -> tuple[Tensor, Tensor]:
        any_, all_ = self.parts[0]._block_mask(r)
        for p in self.parts[1:]:
            a, b = p._block_mask(r)
            if self.op == "&":
                any_, all_ = any_ & a, all_ & b
            else:
                any_, all_ = any_ | a, all_ | b
        return any_, all_

    def __repr__(self) -> str:
        return "(" + f" {self.op} ".join(map(repr, self.parts)) + ")"


class _Not(MaskPattern):
    def __init__(self, inner: MaskPattern) -> None:
        _no_scores((inner,))
        self.inner = inner
        self.batch_dependent = inner.batch_dependent

    @property
    def batch_size(self) -> int | None:
        return self.inner.batch_size

    def _device(self) -> torch.device | None:
        return self.inner._device()

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return ~self.inner.mask_mod(b, h, q_idx, kv_idx)

    def _block_mask(self, r: _BlockRanges) -> tuple[Tensor, Tensor]:
        any_, all_ = self.inner._block_mask(r)
        return ~all_, ~any_

    def __repr__(self) -> str:
        return f"~{self.inner!r}"


class Full(MaskPattern):
    """Every query attends every key."""

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return torch.ones_like(q_idx == kv_idx)

    def _row_counts(self, q_len: int, kv_len: int, q_offset: int) -> Tensor | None:
        return torch.full((q_len,), kv_len, dtype=torch.long)

    def _block_mask(self, r: _BlockRanges) -> tuple[Tensor, Tensor]:
        ones = torch.ones(r.nq, r.nk, dtype=torch.bool, device=r.device)
        return ones, ones.clone()

    def __repr__(self) -> str:
        return "full()"


class Causal(MaskPattern):
    """Key position <= query position."""

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx <= q_idx

    def _row_counts(self, q_len: int, kv_len: int, q_offset: int) -> Tensor | None:
        q = torch.arange(q_len) + q_offset
        return (q + 1).clamp(0, kv_len)

    def _block_mask(self, r: _BlockRanges) -> tuple[Tensor, Tensor]:
        return _window_tiles(r, _FAR, 0)

    def __repr__(self) -> str:
        return "causal()"


class SlidingWindow(MaskPattern):
    """``q - left <= k <= q + right``: ``left`` keys before the query, ``right`` after."""

    def __init__(self, left: int, right: int = 0) -> None:
        self.left = _check_len("left", left)
        self.right = _check_len("right", right)

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        d = q_idx - kv_idx
        return (d <= self.left) & (d >= -self.right)

    def _row_counts(self, q_len: int, kv_len: int, q_offset: int) -> Tensor | None:
        q = torch.arange(q_len) + q_offset
        lo = (q - self.left).clamp(min=0)
        hi = (q + self.right).clamp(max=kv_len - 1)
        return (hi - lo + 1).clamp(min=0)

    def _block_mask(self, r: _BlockRanges) -> tuple[Tensor, Tensor]:
        return _window_tiles(r, self.left, self.right)

    def __repr__(self) -> str:
        return f"sliding_window(left={self.left}, right={self.right})"


class GlobalTokens(MaskPattern):
    """Global positions attend everywhere and are attended from everywhere (Longformer)."""

    def __init__(self, indices: Sequence[int] | Tensor) -> None:
        idx = torch.as_tensor(indices, dtype=torch.long).flatten()
        if idx.numel() and int(idx.min()) < 0:
            raise ValueError(f"global token indices must be >= 0, got {idx.tolist()}")
        self.indices = torch.unique(idx)

        n = int(self.indices.max()) + 1 if self.indices.numel() else 0
        # A lookup table (not torch.isin) so that FlexAttention can trace mask_mod.
        self._table = torch.zeros(n + 1, dtype=torch.bool)
        self._table[self.indices] = True

    def _is_global(self, pos: Tensor) -> Tensor:
        table = self._table.to(pos.device)
        last = table.shape[0] - 1  # the final entry is always False
        inside = (pos >= 0) & (pos < last)
        return table[torch.where(inside, pos, torch.full_like(pos, last))]

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self._is_global(q_idx) | self._is_global(kv_idx)

    def _block_mask(self, r: _BlockRanges) -> tuple[Tensor, Tensor]:
        gq, gk = self._is_global(r.q_positions()), self._is_global(r.k_positions())
        any_ = r.reduce_q(gq, "any")[..., :, None] | r.reduce_k(gk, "any")[..., None, :]
        all_ = r.reduce_q(gq, "all")[..., :, None] | r.reduce_k(gk, "all")[..., None, :]
        return any_, all_  # [P, nq, nk]

    def __repr__(self) -> str:
        return f"global_tokens({self.indices.tolist()})"


class Dilated(MaskPattern):
    """Keys at distances ``0, ±dilation, ..., ±window*dilation`` (two-sided unless ``causal``)."""

    def __init__(self, window: int, dilation: int, causal: bool = False) -> None:
        self.window = _check_len("window", window)
        self.dilation = _check_len("dilation", dilation)
        if dilation < 1:
            raise ValueError(f"dilation must be >= 1, got {dilation}")
        self.causal = causal

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        d = q_idx - kv_idx
        ok = (d.abs() <= self.window * self.dilation) & (d.remainder(self.dilation) == 0)
        return ok & (d >= 0) if self.causal else ok

    def _block_mask(self, r: _BlockRanges) -> tuple[Tensor, Tensor]:
        reach = self.window * self.dilation
        any_, all_ = _window_tiles(r, reach, 0 if self.causal else reach)
        if self.dilation > 1:  # a tile wider than one position always holds a skipped key
            single = (r.q_last == r.q_first) & (r.k_last == r.k_first)
            on_grid = (r.q_first - r.k_first).remainder(self.dilation) == 0
            all_ = all_ & single & on_grid
        return any_, all_

    def __repr__(self) -> str:
        return f"dilated(window={self.window}, dilation={self.dilation}, causal={self.causal})"


class Document(MaskPattern):
    """Attend only within the same document of a packed sequence."""

    def __init__(self, doc_ids: Tensor | Sequence[int]) -> None:
        ids = torch.as_tensor(doc_ids)
        if ids.dim() not in (1, 2) or ids.dtype.is_floating_point:
            raise ValueError(
                f"doc_ids must be an integer tensor (S,) or (B, S), got {ids.dtype} {tuple(ids.shape)}"
            )
        self.doc_ids = ids.long()
        self.batch_dependent = ids.dim() == 2

    @property
    def batch_size(self) -> int | None:
        return int(self.doc_ids.shape[0]) if self.batch_dependent else None

    def _device(self) -> torch.device | None:
        return self.doc_ids.device

    def _lookup(self, b: Tensor, pos: Tensor) -> Tensor:
        n = self.doc_ids.shape[-1]
        ids = self.doc_ids.to(pos.device)
        inside = (pos >= 0) & (pos < n)
        safe = pos.clamp(0, max(n - 1, 0))
        got = ids[b, safe] if self.batch_dependent else ids[safe]
        return torch.where(inside, got, torch.full_like(got, -1))

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        dq, dk = self._lookup(b, q_idx), self._lookup(b, kv_idx)
        return (dq == dk) & (dq >= 0)

    def _block_mask(self, r: _BlockRanges) -> tuple[Tensor, Tensor]:
        n_b = (self.batch_size or 1) if self.batch_dependent else 1
        b = torch.arange(n_b, device=r.device).view(-1, 1)  # [B, 1]

        def ranges(pos: Tensor, op: str) -> tuple[Tensor, ...]:
            d = self._lookup(b, pos)  # [B', n]; -1 outside a document
            valid = d >= 0
            big = torch.full_like(d, _BIG)
            reduce = r.reduce_q if op == "q" else r.reduce_k
            lo = reduce(torch.where(valid, d, big), "min")
            hi = reduce(torch.where(valid, d, -big), "max")
            return lo, hi, reduce(valid, "any"), reduce(valid, "all")  # each [B', n_tiles]

        qlo, qhi, q_any, q_all = ranges(r.q_positions(), "q")
        klo, khi, k_any, k_all = ranges(r.k_positions(), "k")
        overlap = (qlo[:, :, None] <= khi[:, None, :]) & (klo[:, None, :] <= qhi[:, :, None])
        any_ = overlap & q_any[:, :, None] & k_any[:, None, :]  # [B', nq, nk]
        same = (qlo == qhi)[:, :, None] & (klo == khi)[:, None, :]
        same = same & (qlo[:, :, None] == klo[:, None, :])
        all_ = same & q_all[:, :, None] & k_all[:, None, :]  # [B', nq, nk]
        return any_, all_

    def __repr__(self) -> str:
        return f"document(shape={tuple(self.doc_ids.shape)})"


class PrefixLM(MaskPattern):
    """Bidirectional over the first ``prefix_len`` keys, causal after them."""

    def __init__(self, prefix_len: int) -> None:
        self.prefix_len = _check_len("prefix_len", prefix_len)

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx < self.prefix_len) | (kv_idx <= q_idx)

    def _row_counts(self, q_len: int, kv_len: int, q_offset: int) -> Tensor | None:
        q = torch.arange(q_len) + q_offset
        return torch.maximum(q + 1, torch.full_like(q, self.prefix_len)).clamp(0, kv_len)

    def _block_mask(self, r: _BlockRanges) -> tuple[Tensor, Tensor]:
        c_any, c_all = _window_tiles(r, _FAR, 0)
        return c_any | (r.k_first < self.prefix_len), c_all | (r.k_last < self.prefix_len)

    def __repr__(self) -> str:
        return f"prefix_lm({self.prefix_len})"


class Padding(MaskPattern):
    """Key padding from an HF-style ``attention_mask`` ``(B, S)`` of 1/0."""

    batch_dependent = True

    def __init__(self, attention_mask: Tensor) -> None:
        self.keep = padding_mask(attention_mask)[:, 0, 0, :]  # [B, S]

    @property
    def batch_size(self) -> int | None:
        return int(self.keep.shape[0])

    def _device(self) -> torch.device | None:
        return self.keep.device

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        n = self.keep.shape[-1]
        inside = (kv_idx >= 0) & (kv_idx < n)
        got = self.keep.to(kv_idx.device)[b, kv_idx.clamp(0, max(n - 1, 0))]
        return got & inside & (q_idx == q_idx)

    def _block_mask(self, r: _BlockRanges) -> tuple[Tensor, Tensor]:
        k = r.k_positions()  # [P, S]
        n = self.keep.shape[-1]
        b = torch.arange(self.keep.shape[0], device=r.device).view(-1, 1)  # [B, 1]
        inside = (k >= 0) & (k < n)
        keep = self.keep.to(r.device)[b, k.clamp(0, max(n - 1, 0))] & inside  # [B, S]
        any_ = r.reduce_k(keep, "any").unsqueeze(-2)  # [B, 1, nk]
        all_ = r.reduce_k(keep, "all").unsqueeze(-2)
        return any_, all_

    def __repr__(self) -> str:
        return f"padding(shape={tuple(self.keep.shape)})"


def full() -> MaskPattern:
    """Every query attends every key."""
    return Full()


def causal() -> MaskPattern:
    """Causal pattern: a query at position ``i`` attends keys ``j <= i``."""
    return Causal()


def sliding_window(left: int, right: int = 0) -> MaskPattern:
    """Local window: query ``i`` attends keys ``i - left ... i + right``.

    ``sliding_window(w - 1)`` is the causal window of ``w`` keys used by Mistral
    (``sliding_window=w`` in its config); ``sliding_window(w, w)`` is the
    two-sided window of Longformer.
    """
    return SlidingWindow(left, right)


def global_tokens(indices: Sequence[int] | Tensor) -> MaskPattern:
    """Global tokens (Longformer): these positions attend and are attended everywhere."""
    return GlobalTokens(indices)


def dilated(window: int, dilation: int, *, causal: bool = False) -> MaskPattern:
    """Dilated window: keys at distances multiple of ``dilation`` up to ``window*dilation``."""
    return Dilated(window, dilation, causal)


def document(doc_ids: Tensor | Sequence[int]) -> MaskPattern:
    """Same-document mask for packed sequences; ``& causal()`` makes it block-causal."""
    return Document(doc_ids)


def prefix_lm(prefix_len: int) -> MaskPattern:
    """Prefix-LM: the prefix attends bidirectionally, the rest causally."""
    return PrefixLM(prefix_len)


def padding(attention_mask: Tensor) -> MaskPattern:
    """Key-padding pattern from an HF-style ``(B, S)`` 1/0 ``attention_mask``."""
    return Padding(attention_mask)
