"""Tile geometry: which ``block_q x block_k`` tiles of the score matrix hold which positions.

A tile is described by the positions it holds (the smallest and largest query
position, the smallest and largest valid key position), so one set of closed forms
serves contiguous prefill, cached decoding and rows of slots with holes (``-1``).
Block-sparse kernels skip the tiles a pattern leaves empty and drop the element mask
where it attends a tile entirely (Dao et al., 2022, "FlashAttention", sec. 3.3).

Shape notation: ``P`` rows of positions (1 or the batch), ``L`` queries, ``S`` keys,
``nq``/``nk`` query/key tiles.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["default_positions", "reduce_tiles"]

#: A distance beyond any position: the unbounded side of a window (causal's left).
_FAR = 1 << 62
#: Fill of an empty tile's key range (exact as a float, beyond any real position).
_BIG = 1 << 40


def default_positions(
    n: int, *, offset: int = 0, device: torch.device | str | None = None
) -> Tensor:
    """Positions ``offset .. offset+n-1`` as a long ``[1, n]`` (torch's top-left when 0)."""
    return (torch.arange(n, device=device) + offset).view(1, -1)


def reduce_tiles(x: Tensor, block: int, n_tiles: int, op: str) -> Tensor:
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
        return reduce_tiles(x, self.block_q, self.nq, op)

    def reduce_k(self, x: Tensor, op: str) -> Tensor:
        """Reduce a per-key-position ``[.., S]`` to per-tile ``[.., nk]``."""
        return reduce_tiles(x, self.block_k, self.nk, op)


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
