"""The structured patterns: causal, windows, global tokens, dilated, documents, prefix-LM, padding.

Each pattern gives its predicate (``mask_mod``), its tile geometry in closed form
(``_block_mask``) and, where there is one, its count of attended pairs in closed form
(``_count``, exact integers for any length: :mod:`attnlab.counting`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch
from torch import Tensor

from attnlab import counting
from attnlab.functional.masks.algebra import MaskPattern
from attnlab.functional.masks.dense import _check_len, padding_mask
from attnlab.functional.masks.geometry import _BIG, _FAR, _BlockRanges, _window_tiles

__all__ = [
    "Causal",
    "Dilated",
    "Document",
    "Full",
    "GlobalTokens",
    "Padding",
    "PrefixLM",
    "SlidingWindow",
    "causal",
    "dilated",
    "document",
    "full",
    "global_tokens",
    "padding",
    "prefix_lm",
    "sliding_window",
]


class Full(MaskPattern):
    """Every query attends every key."""

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return torch.ones_like(q_idx == kv_idx)

    def _band(self) -> tuple[int, int] | None:
        return counting.FAR, counting.FAR

    def _block_mask(self, r: _BlockRanges) -> tuple[Tensor, Tensor]:
        ones = torch.ones(r.nq, r.nk, dtype=torch.bool, device=r.device)
        return ones, ones.clone()

    def __repr__(self) -> str:
        return "full()"


class Causal(MaskPattern):
    """Key position <= query position."""

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx <= q_idx

    def _band(self) -> tuple[int, int] | None:
        return counting.FAR, 0

    def _block_mask(self, r: _BlockRanges) -> tuple[Tensor, Tensor]:
        return _window_tiles(r, _FAR, 0)

    def __repr__(self) -> str:
        return "causal()"


class SlidingWindow(MaskPattern):
    """``q - left <= k <= q + right``: ``left`` keys before the query, ``right`` after."""

    def __init__(self, left: int, right: int = 0) -> None:
        self.left = _check_len("left", left)
        self.right = _check_len("right", right)

    def _params(self) -> tuple[object, ...]:
        return (self.left, self.right)

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        d = q_idx - kv_idx
        return (d <= self.left) & (d >= -self.right)

    def _band(self) -> tuple[int, int] | None:
        return self.left, self.right

    def _block_mask(self, r: _BlockRanges) -> tuple[Tensor, Tensor]:
        return _window_tiles(r, self.left, self.right)

    def __repr__(self) -> str:
        return f"sliding_window(left={self.left}, right={self.right})"


class GlobalTokens(MaskPattern):
    """Global positions attend everywhere and are attended from everywhere (Longformer)."""

    def __init__(self, indices: Sequence[int] | Tensor) -> None:
        if isinstance(indices, Tensor):
            if indices.dtype.is_floating_point or indices.dtype.is_complex:
                raise TypeError(
                    f"global token indices must be integers, got a {indices.dtype} tensor"
                )
            idx = indices.long().flatten()
        else:
            values = list(indices)
            bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int)]
            if bad:
                raise TypeError(f"global token indices must be ints, got {bad[:5]}")
            idx = torch.tensor(values, dtype=torch.long)
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

    def _params(self) -> tuple[object, ...]:
        return (int(self.indices.numel()),)

    def _check_fits(self, q_end: int, k_end: int) -> None:
        n = max(q_end, k_end)
        if self.indices.numel() and int(self.indices[-1]) >= n:
            raise ValueError(
                f"global token index {int(self.indices[-1])} is beyond the sequence "
                f"(positions 0..{n - 1}); global_tokens takes positions inside it"
            )

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self._is_global(q_idx) | self._is_global(kv_idx)

    def _sorted(self) -> list[int]:
        return [int(i) for i in self.indices.tolist()]

    def _count(self, q_lo: int, q_hi: int, kv_len: int) -> int | None:
        # a global query sees every key; any other query sees the global keys
        g = self._sorted()
        rows = bisect.bisect_right(g, q_hi) - bisect.bisect_left(g, q_lo)
        cols = bisect.bisect_left(g, kv_len)
        return rows * kv_len + (q_hi - q_lo + 1 - rows) * cols

    def _count_or_band(
        self, left: int, right: int, q_lo: int, q_hi: int, kv_len: int
    ) -> int | None:
        # every query: its band plus the global keys outside it; global queries: all keys
        g = self._sorted()
        g_keys = g[: bisect.bisect_left(g, kv_len)]
        band = counting.band_pairs(left, right, q_lo, q_hi, 0, kv_len - 1)
        inside = sum(counting.band_pairs(left, right, q_lo, q_hi, k, k) for k in g_keys)
        total = band + (q_hi - q_lo + 1) * len(g_keys) - inside
        for p in g[bisect.bisect_left(g, q_lo) : bisect.bisect_right(g, q_hi)]:
            own = counting.band_pairs(left, right, p, p, 0, kv_len - 1)
            near = bisect.bisect_right(g_keys, p + right) - bisect.bisect_left(g_keys, p - left)
            total += kv_len - (own + len(g_keys) - near)
        return total

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
        self.dilation = _check_len("dilation", dilation, min_value=1)
        self.causal = causal

    def _params(self) -> tuple[object, ...]:
        return (self.window, self.dilation, self.causal)

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        d = q_idx - kv_idx
        ok = (d.abs() <= self.window * self.dilation) & (d.remainder(self.dilation) == 0)
        return ok & (d >= 0) if self.causal else ok

    def _count(self, q_lo: int, q_hi: int, kv_len: int) -> int | None:
        return counting.dilated_pairs(self.window, self.dilation, self.causal, q_lo, q_hi, kv_len)

    def _tile_band(self) -> tuple[int, int] | None:
        reach = self.window * self.dilation
        return reach, 0 if self.causal else reach

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

    def _check_fits(self, q_end: int, k_end: int) -> None:
        n, need = self.doc_ids.shape[-1], max(q_end, k_end)
        if n < need:
            raise ValueError(
                f"document ids cover {n} positions but the call's sequence has {need}; "
                "pass one id per position (-1 for none)"
            )

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        dq, dk = self._lookup(b, q_idx), self._lookup(b, kv_idx)
        return (dq == dk) & (dq >= 0)

    def _runs(self) -> list[dict[int, list[tuple[int, int]]]]:
        """Per sequence: each document's runs of consecutive positions ``(first, last)``."""
        ids = self.doc_ids.view(-1, self.doc_ids.shape[-1]).cpu()  # [B, n]
        out: list[dict[int, list[tuple[int, int]]]] = []
        for row in ids:
            starts = [0, *((row[1:] != row[:-1]).nonzero().flatten() + 1).tolist()]
            ends = [*(s - 1 for s in starts[1:]), row.numel() - 1]
            runs: dict[int, list[tuple[int, int]]] = {}
            for a, e in zip(starts, ends, strict=True):
                if row.numel() and int(row[a]) >= 0:
                    runs.setdefault(int(row[a]), []).append((a, e))
            out.append(runs)
        return out

    def _count_in_band(
        self, left: int, right: int, q_lo: int, q_hi: int, kv_len: int
    ) -> int | None:
        total = 0
        for runs in self._runs():  # O(runs) per document, whatever the length
            for spans in runs.values():
                for qa, qb in spans:
                    for ka, kb in spans:
                        total += counting.band_pairs(
                            left, right, max(qa, q_lo), min(qb, q_hi), ka, min(kb, kv_len - 1)
                        )
        return total

    def _count(self, q_lo: int, q_hi: int, kv_len: int) -> int | None:
        return self._count_in_band(counting.FAR, counting.FAR, q_lo, q_hi, kv_len)

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

    def _params(self) -> tuple[object, ...]:
        return (self.prefix_len,)

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx < self.prefix_len) | (kv_idx <= q_idx)

    def _count(self, q_lo: int, q_hi: int, kv_len: int) -> int | None:
        # query q sees min(S, max(prefix, q + 1)) keys: affine between prefix and S
        def seen(q: int) -> int:
            return min(kv_len, max(self.prefix_len, q + 1))

        return counting.sum_clamped(seen, q_lo, q_hi, (self.prefix_len, kv_len, 0))

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

    def _count_in_band(
        self, left: int, right: int, q_lo: int, q_hi: int, kv_len: int
    ) -> int | None:
        keep = self.keep[:, :kv_len].cpu()
        total = 0
        for row in keep:  # runs of real tokens: O(runs) per sequence
            edges = torch.diff(
                row.long(),
                prepend=torch.zeros(1, dtype=torch.long),
                append=torch.zeros(1, dtype=torch.long),
            )
            starts = (edges == 1).nonzero().flatten().tolist()
            ends = ((edges == -1).nonzero().flatten() - 1).tolist()
            for a, e in zip(starts, ends, strict=True):
                total += counting.band_pairs(left, right, q_lo, q_hi, a, e)
        return total

    def _count(self, q_lo: int, q_hi: int, kv_len: int) -> int | None:
        kept = int(self.keep[:, :kv_len].sum())
        return (q_hi - q_lo + 1) * kept

    def _check_fits(self, q_end: int, k_end: int) -> None:
        n = self.keep.shape[-1]
        if n < k_end:
            raise ValueError(
                f"the padding mask covers {n} positions but the call's keys reach {k_end}; "
                "pass an attention_mask of 1/0 over every key position"
            )

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
