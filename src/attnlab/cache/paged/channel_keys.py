"""Paged keys quantized per channel, one block a group (KIVI's keys in a paged pool).

KIVI (Liu et al., 2024, arXiv:2402.02750) quantizes keys **per channel** over a group of
tokens and keeps the newest, partial group in full precision. In a paged pool the block is
the natural group: a block's keys are held in float while it fills, and when its last slot
is written they are quantized with one scale (and zero point) per head and channel over
the block's ``bs`` tokens; the float copy is then dropped. This equals
:class:`~attnlab.cache.quantized.QuantizedKVCache` with ``key_mode="channel"``,
``group=bs`` and ``residual=0`` (whole groups quantized, the partial group in float).

Shapes, one layer (``N`` blocks, ``bs`` block size, ``H`` heads, ``D`` head dim, ``b``
bits, ``c`` = 1 for int8 (symmetric), 2 otherwise (scale and minimum)):

* ``levels [N * bs, H, D * b / 8]`` (int8, or uint8 packed as the contiguous cache packs);
* ``stats [N, H, c, D]`` float32, the block's per-channel scale (and minimum);
* ``stage [E, bs, H, D]`` in the pool's dtype: the float keys of the blocks being filled,
  ``stage_of [N]`` the entry of each block (-1: quantized, or never written).

A block is filled in order (a sequence appends), so writing its last slot means it is
full. A write into a quantized block (a block reused by another sequence, or rewritten
after a cut-back) first moves it back to the stage, its stored approximation as the
starting content. Blocks freed partly filled give their entry back
(:meth:`ChannelKeys.drop`), so the stage holds about one block per live sequence.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from attnlab.cache.quantized import _dequantize, _quantize

__all__ = ["ChannelKeys"]


class ChannelKeys:
    """One layer's keys, per channel per block (see the module docstring).

    Args:
        num_blocks: blocks ``N``.
        block_size: tokens per block ``bs`` (the quantization group).
        num_kv_heads: heads ``H``.
        head_dim: ``D`` (even for int4).
        bits: 8 or 4.
        dtype: of the float keys written, read and staged.
        device: of every tensor.
    """

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        bits: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.bs, self.bits, self.dtype = block_size, bits, dtype
        self.shape = (num_kv_heads, head_dim)
        store = torch.int8 if bits == 8 else torch.uint8
        width = head_dim * bits // 8
        self.levels = torch.zeros(num_blocks * block_size, num_kv_heads, width, dtype=store, device=device)  # fmt: skip
        c = 1 if bits == 8 else 2
        self.stats = torch.zeros(num_blocks, num_kv_heads, c, head_dim, device=device)
        self.stage = torch.zeros(0, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)  # fmt: skip
        self.stage_of = torch.full((num_blocks,), -1, dtype=torch.long, device=device)
        self._spare: list[int] = []  # free stage entries

    # ---------------------------------------------------------------- sizes

    def bytes_per_block(self) -> int:
        """Stored bytes of one block: levels and statistics (the stage is not counted)."""
        levels = self.bs * self.levels[0].numel() * self.levels.element_size()
        return levels + self.stats[0].numel() * self.stats.element_size()

    def staged_blocks(self) -> int:
        """Blocks held in float now (being filled)."""
        return int((self.stage_of >= 0).sum())

    def stage_nbytes(self) -> int:
        """Bytes of the float stage (all its entries, used or spare)."""
        return self.stage.numel() * self.stage.element_size()

    # ---------------------------------------------------------------- stage

    def _entries(self, k: int) -> Tensor:
        """``k`` free stage entries (the stage grows by doubling)."""
        while len(self._spare) < k:
            old = self.stage.shape[0]
            grow = max(k - len(self._spare), old, 4)
            more = self.stage.new_zeros((grow, *self.stage.shape[1:]))
            self.stage = torch.cat([self.stage, more])
            self._spare.extend(range(old + grow - 1, old - 1, -1))
        return torch.tensor([self._spare.pop() for _ in range(k)], device=self.stage.device)

    def _release(self, blocks: Tensor) -> None:
        self._spare.extend(int(e) for e in self.stage_of[blocks].tolist() if e >= 0)
        self.stage_of[blocks] = -1

    def _slots(self, blocks: Tensor) -> Tensor:
        return (blocks[:, None] * self.bs + torch.arange(self.bs, device=blocks.device)).view(-1)

    def _expand(self, blocks: Tensor) -> Tensor:
        """The stored approximation of ``blocks [k]``: ``[k, bs, H, D]`` float32."""
        q = self.levels.index_select(0, self._slots(blocks)).view(len(blocks), self.bs, *self.levels.shape[1:])  # fmt: skip
        st = self.stats.index_select(0, blocks)[:, None]  # [k, 1, H, c, D]
        low = None if self.bits == 8 else st[:, :, :, 1]
        return _dequantize(q, st[:, :, :, 0], low, self.bits)

    # ---------------------------------------------------------------- writes and reads

    def write(self, slots: Tensor, key: Tensor) -> None:
        """Store ``key [n, H, D]`` at ``slots [n]``; quantize every block whose last slot
        this writes."""
        bs = self.bs
        blocks, offsets = slots // bs, slots % bs
        touched = torch.unique(blocks)
        fresh = touched[self.stage_of[touched] < 0]
        if fresh.numel():  # start filling: the stored approximation as the start
            entries = self._entries(fresh.numel())
            self.stage[entries] = self._expand(fresh).to(self.dtype)
            self.stage_of[fresh] = entries
        self.stage[self.stage_of[blocks], offsets] = key
        full = torch.unique(blocks[offsets == bs - 1])
        if not full.numel():
            return
        x = self.stage[self.stage_of[full]]  # [k, bs, H, D]
        q, s, low = _quantize(x, self.bits, dim=1)  # one scale per block, head and channel
        self.levels.index_copy_(0, self._slots(full), q.reshape(-1, *self.levels.shape[1:]))
        self.stats[full, :, 0] = s[:, 0]
        if low is not None:
            self.stats[full, :, 1] = low[:, 0]
        self._release(full)

    def read(self, slots: Tensor) -> Tensor:
        """Keys ``[n, H, D]`` of ``slots [n]`` in ``dtype``: dequantized, or from the stage
        for blocks being filled."""
        blocks = slots // self.bs
        st = self.stats.index_select(0, blocks)  # [n, H, c, D]
        low = None if self.bits == 8 else st[:, :, 1]
        out = _dequantize(self.levels.index_select(0, slots), st[:, :, 0], low, self.bits)
        out = out.to(self.dtype)
        entry = self.stage_of[blocks]
        staged = entry >= 0
        if bool(staged.any()):
            out[staged] = self.stage[entry[staged], slots[staged] % self.bs]
        return out

    def copy_blocks(self, copies: Iterable[tuple[int, int]]) -> None:
        """Copy block ``src`` onto ``dst`` (copy-on-write), the stage included."""
        for src, dst in copies:
            s, d = (torch.tensor([b], device=self.stage_of.device) for b in (src, dst))
            self.levels[self._slots(d)] = self.levels[self._slots(s)]
            self.stats[dst] = self.stats[src]
            self._release(d)
            if int(self.stage_of[src]) >= 0:
                e = self._entries(1)
                self.stage[e] = self.stage[self.stage_of[s]]
                self.stage_of[d] = e

    def drop(self, blocks: Iterable[int]) -> None:
        """Forget the float keys of ``blocks`` (freed, no holder left)."""
        b = torch.tensor(list(blocks), dtype=torch.long, device=self.stage_of.device)
        if b.numel():
            self._release(b)
