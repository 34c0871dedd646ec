"""The pattern combinators: ``a & b``, ``a | b``, ``~a`` and a pattern with score modifiers.

Each is a :class:`~attnlab.functional.masks.algebra.MaskPattern` built from others by
its operators (``&``, ``|``, ``~``, :meth:`~attnlab.functional.masks.algebra.MaskPattern.with_scores`):
evaluation, counting in closed form where the parts allow it, and the tile geometry are
those of the parts, combined.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab import counting
from attnlab.functional.masks.algebra import MaskPattern
from attnlab.functional.masks.geometry import _BlockRanges
from attnlab.functional.score_mods import ScoreMod

__all__ = ["Combined", "Not", "Scored", "as_pattern", "no_scores"]


def no_scores(parts: tuple[MaskPattern, ...]) -> None:
    for p in parts:
        if p.score_mods:
            raise ValueError(
                f"combine patterns before adding score modifiers: {p!r} carries "
                f"{list(p.score_mods)}; write (a & b).with_scores(...)"
            )


def as_pattern(x: object) -> MaskPattern:
    if not isinstance(x, MaskPattern):
        raise TypeError(
            f"patterns combine only with other patterns, got {type(x).__name__}; "
            "use masks.combine() for dense tensors"
        )
    return x


class Scored(MaskPattern):
    """A pattern carrying score modifiers; the mask itself is the inner pattern's."""

    def __init__(self, inner: MaskPattern, mods: tuple[ScoreMod, ...]) -> None:
        self.inner = inner._unscored()
        self.score_mods = mods
        self.batch_dependent = inner.batch_dependent

    def _unscored(self) -> MaskPattern:
        return self.inner

    def _structure(self) -> tuple[object, ...]:
        return ("scored", self.inner.structure(), *(repr(m) for m in self.score_mods))

    def _leaves(self) -> tuple[MaskPattern, ...]:
        return self.inner._leaves()

    @property
    def batch_size(self) -> int | None:
        return self.inner.batch_size

    def _device(self) -> torch.device | None:
        return self.inner._device()

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.inner.mask_mod(b, h, q_idx, kv_idx)

    def _count(self, q_lo: int, q_hi: int, kv_len: int) -> int | None:
        return self.inner._count(q_lo, q_hi, kv_len)

    def _band(self) -> tuple[int, int] | None:
        return self.inner._band()

    def _tile_band(self) -> tuple[int, int] | None:
        return self.inner._tile_band()

    def _block_mask(self, r: _BlockRanges) -> tuple[Tensor, Tensor]:
        return self.inner._block_mask(r)

    def __repr__(self) -> str:
        return f"{self.inner!r}.with_scores({', '.join(map(repr, self.score_mods))})"


class Combined(MaskPattern):
    def __init__(self, op: str, parts: tuple[MaskPattern, ...]) -> None:
        no_scores(parts)
        sizes = {p.batch_size or 0 for p in parts if p.batch_dependent}
        if len(sizes) > 1:
            raise ValueError(
                f"cannot combine patterns built for different batch sizes {sorted(sizes)}"
            )
        self.op = op
        # (a & b) & c is a & b & c: flat, so that counting sees every part
        flat: list[MaskPattern] = []
        for p in parts:
            flat.extend(p.parts if isinstance(p, Combined) and p.op == op else (p,))
        self.parts: tuple[MaskPattern, ...] = tuple(flat)
        self.batch_dependent = any(p.batch_dependent for p in parts)
        self._batch = next(iter(sizes)) if sizes else None

    @property
    def batch_size(self) -> int | None:
        return self._batch

    def _structure(self) -> tuple[object, ...]:
        return (self.op, *(p.structure() for p in self.parts))

    def _leaves(self) -> tuple[MaskPattern, ...]:
        return tuple(leaf for p in self.parts for leaf in p._leaves())

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

    def _band(self) -> tuple[int, int] | None:
        bands = [p._band() for p in self.parts]
        if self.op != "&" or any(b is None for b in bands):
            return None
        return min(b[0] for b in bands if b), min(b[1] for b in bands if b)

    def _tile_band(self) -> tuple[int, int] | None:
        bands = [p._tile_band() for p in self.parts]
        if self.op != "&" or any(b is None for b in bands):
            return None
        return min(b[0] for b in bands if b), min(b[1] for b in bands if b)

    def _count(self, q_lo: int, q_hi: int, kv_len: int) -> int | None:
        band = self._band()
        if band is not None:
            return counting.band_pairs(*band, q_lo, q_hi, 0, kv_len - 1)
        bands = [p._band() for p in self.parts]
        others = [p for p, b in zip(self.parts, bands, strict=True) if b is None]
        if len(others) != 1 or len(self.parts) < 2:
            return None
        left = min((b[0] for b in bands if b is not None), default=counting.FAR)
        right = min((b[1] for b in bands if b is not None), default=counting.FAR)
        if self.op == "&":  # a band and one pattern that knows its count within a band
            return others[0]._count_in_band(left, right, q_lo, q_hi, kv_len)
        if len(self.parts) == 2:  # a band or one pattern that knows its union with a band
            return others[0]._count_or_band(left, right, q_lo, q_hi, kv_len)
        return None

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


class Not(MaskPattern):
    def __init__(self, inner: MaskPattern) -> None:
        no_scores((inner,))
        self.inner = inner
        self.batch_dependent = inner.batch_dependent

    @property
    def batch_size(self) -> int | None:
        return self.inner.batch_size

    def _device(self) -> torch.device | None:
        return self.inner._device()

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return ~self.inner.mask_mod(b, h, q_idx, kv_idx)

    def _structure(self) -> tuple[object, ...]:
        return ("~", self.inner.structure())

    def _leaves(self) -> tuple[MaskPattern, ...]:
        return self.inner._leaves()

    def _count(self, q_lo: int, q_hi: int, kv_len: int) -> int | None:
        inner = self.inner._count(q_lo, q_hi, kv_len)
        if inner is None:
            return None
        n = (self.batch_size or 1) if self.batch_dependent else 1
        return n * (q_hi - q_lo + 1) * kv_len - inner

    def _block_mask(self, r: _BlockRanges) -> tuple[Tensor, Tensor]:
        any_, all_ = self.inner._block_mask(r)
        return ~all_, ~any_

    def __repr__(self) -> str:
        return f"~{self.inner!r}"
