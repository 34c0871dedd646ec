"""KV storage: the tensors of a paged KV cache, one key and one value pool per layer.

Shape notation: ``N`` blocks, ``bs`` block size, ``H_kv`` key/value heads, ``h_d`` key
head dim, ``h_v`` value head dim.

Layer ``i`` keeps ``keys[i] [N * bs, H_kv, h_d]`` and ``values[i] [N * bs, H_kv, h_v]``;
block ``b`` is the slots ``b * bs .. (b + 1) * bs - 1`` of every layer. Which block holds
what is the :class:`~attnlab.cache.paged.manager.KVManager`'s business; the storage only
writes slots, copies blocks (copy-on-write) and says how many bytes a block costs.

With ``kv_dtype="int8"`` or ``"int4"`` the pools hold levels instead (int8 ``[N * bs,
H_kv, h_d]``; int4 two levels a byte, ``[N * bs, H_kv, h_d / 2]``) and ``key_stats[i]``/
``value_stats[i]`` ``[N * bs, H_kv, 2]`` float32 the scale and zero point of each slot and
head: keys and values quantized **per token**. With ``"int8-channel"``/``"int4-channel"``
the keys are quantized **per channel** as KIVI quantizes them, one block a group: a
block's keys stay in float while it fills and are quantized per head and channel over its
``bs`` tokens when its last slot is written (:class:`~attnlab.cache.paged.channel_keys.
ChannelKeys`; ``keys[i]`` are then its levels and ``key_stats`` is empty); values stay
per token. :meth:`read` dequantizes the slots a step gathers; backends that read the
pools directly are not used with quantized pools (:attr:`quantized`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from attnlab.cache.paged.channel_keys import ChannelKeys
from attnlab.cache.quantized import _dequantize, _quantize
from attnlab.functional._checks import check_positive_int

#: the quantized storage kinds of a paged pool: keys per token, or per channel in each
#: block (values per token in both; see the module docstring)
PAGED_KV_DTYPES = ("int8", "int4", "int8-channel", "int4-channel")

__all__ = ["PAGED_KV_DTYPES", "KVStorage"]


class KVStorage:
    """Preallocated key/value pools for ``num_layers`` attention layers.

    Args:
        num_layers: attention layers (one key and one value pool each).
        num_kv_heads: key/value heads ``H_kv``.
        head_dim: key head dim ``h_d`` (and values', unless ``value_head_dim``).
        num_blocks: blocks ``N``.
        block_size: tokens per block ``bs``.
        dtype, device: of the pools.
        value_head_dim: ``h_v`` when it differs from ``h_d``.
        kv_dtype: None (the pools hold ``dtype``), ``"int8"``/``"int4"`` (levels and
            per-slot scales; ``dtype`` is then what :meth:`read` returns and
            :meth:`write` accepts) or ``"int8-channel"``/``"int4-channel"`` (keys per
            channel in each block, values per token).

    Raises:
        ValueError: a size that is not a positive int, an unknown ``kv_dtype``, or an
            odd head dim for int4.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        value_head_dim: int | None = None,
        kv_dtype: str | None = None,
    ) -> None:
        if kv_dtype is not None and kv_dtype not in PAGED_KV_DTYPES:
            raise ValueError(
                f"kv_dtype of a paged pool must be None or one of {list(PAGED_KV_DTYPES)}, "
                f"got {kv_dtype!r}"
            )
        if not isinstance(num_layers, int) or num_layers < 0:
            raise ValueError(f"num_layers must be an int >= 0, got {num_layers!r}")
        for name, value in (
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
        ):
            check_positive_int(name, value)
        vd = (
            head_dim
            if value_head_dim is None
            else check_positive_int("value_head_dim", value_head_dim)
        )
        slots = num_blocks * block_size
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        self.bits = {"int8": 8, "int4": 4}.get((kv_dtype or "").removesuffix("-channel"), 0)
        self.key_mode = "channel" if (kv_dtype or "").endswith("-channel") else "token"
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        store = dtype
        kd, width_v = head_dim, vd
        if self.bits:
            if self.bits == 4 and (head_dim % 2 or vd % 2):
                raise ValueError(f"an int4 paged pool needs even head dims, got {head_dim}, {vd}")
            store = torch.int8 if self.bits == 8 else torch.uint8
            kd, width_v = head_dim * self.bits // 8, vd * self.bits // 8
        self.keys = [
            torch.zeros(slots, num_kv_heads, kd, dtype=store, device=device)
            for _ in range(num_layers)
        ]  # [N*bs, H_kv, h_d] each (levels: h_d * bits / 8)
        self.values = [
            torch.zeros(slots, num_kv_heads, width_v, dtype=store, device=device)
            for _ in range(num_layers)
        ]  # [N*bs, H_kv, h_v] each
        self.channel_keys: list[ChannelKeys] = []
        if self.key_mode == "channel":
            self.channel_keys = [
                ChannelKeys(
                    num_blocks=num_blocks,
                    block_size=block_size,
                    num_kv_heads=num_kv_heads,
                    head_dim=head_dim,
                    bits=self.bits,
                    dtype=dtype,
                    device=self._device,
                )
                for _ in range(num_layers)
            ]
            self.keys = [c.levels for c in self.channel_keys]
        n_stats = num_layers if self.bits else 0
        self.key_stats = [
            torch.zeros(slots, num_kv_heads, 2, dtype=torch.float32, device=device)
            for _ in range(n_stats if self.key_mode == "token" else 0)
        ]  # [N*bs, H_kv, (scale, zero point)]
        self.value_stats = [
            torch.zeros(slots, num_kv_heads, 2, dtype=torch.float32, device=device)
            for _ in range(n_stats)
        ]

    @property
    def quantized(self) -> bool:
        """Whether the pools hold levels (read them with :meth:`read`, not directly)."""
        return self.bits > 0

    @property
    def device(self) -> torch.device:
        return self._device

    def _tensors(self) -> list[Tensor]:
        """The tensors with one row per slot (per-channel keys keep their own)."""
        keys = [] if self.channel_keys else self.keys
        return [*keys, *self.values, *self.key_stats, *self.value_stats]

    def bytes_per_block(self) -> int:
        """Bytes of one block over all layers (keys and values, with their scales; the
        float keys of per-channel blocks being filled are not counted:
        :meth:`stage_nbytes`)."""
        per_slot = sum(t[0].numel() * t.element_size() for t in self._tensors())
        return per_slot * self.block_size + sum(c.bytes_per_block() for c in self.channel_keys)

    def stage_nbytes(self) -> int:
        """Bytes of the float keys held for per-channel blocks being filled (0 otherwise)."""
        return sum(c.stage_nbytes() for c in self.channel_keys)

    def drop_partial(self, blocks: Iterable[int]) -> None:
        """Forget the float keys of freed ``blocks`` (per-channel keys only; else a no-op)."""
        blocks = list(blocks)
        for c in self.channel_keys:
            c.drop(blocks)

    def copy_blocks(self, copies: Iterable[tuple[int, int]]) -> None:
        """Copy block ``src`` onto block ``dst`` in every layer, for each ``(src, dst)``."""
        bs = self.block_size
        copies = list(copies)
        for c in self.channel_keys:
            c.copy_blocks(copies)
        for old, new in copies:
            src, dst = slice(old * bs, (old + 1) * bs), slice(new * bs, (new + 1) * bs)
            for t in self._tensors():
                t[dst] = t[src]

    def write(self, layer: int, slots: Tensor, key: Tensor, value: Tensor) -> None:
        """Store ``key [n, H_kv, h_d]``/``value [n, H_kv, h_v]`` at pool ``slots [n]``.

        Raises:
            TypeError: keys of another dtype than the pool's.
        """
        if key.dtype != self.dtype:
            raise TypeError(f"keys are {key.dtype}, the paged pool holds {self.dtype}")
        if not self.bits:
            self.keys[layer].index_copy_(0, slots, key)
            self.values[layer].index_copy_(0, slots, value)
            return
        pairs = [(value, self.values[layer], self.value_stats[layer])]
        if self.channel_keys:
            self.channel_keys[layer].write(slots, key)
        else:
            pairs.insert(0, (key, self.keys[layer], self.key_stats[layer]))
        for x, pool, stats in pairs:
            q, scale, low = _quantize(x, self.bits, dim=-1)  # per slot and head
            pool.index_copy_(0, slots, q)
            st = torch.cat([scale, scale if low is None else low], dim=-1)  # [n, H_kv, 2]
            stats.index_copy_(0, slots, st)

    def read(self, layer: int, slots: Tensor) -> tuple[Tensor, Tensor]:
        """Keys ``[n, H_kv, h_d]`` and values ``[n, H_kv, h_v]`` of pool ``slots [n]``, in
        the pool's ``dtype`` (dequantized when the pools hold levels)."""
        kp, vp = self.keys[layer], self.values[layer]
        if not self.bits:
            return kp.index_select(0, slots), vp.index_select(0, slots)
        out = []
        pairs = [(vp, self.value_stats[layer])]
        if not self.channel_keys:
            pairs.insert(0, (kp, self.key_stats[layer]))
        for pool, stats in pairs:
            st = stats.index_select(0, slots)
            low = None if self.bits == 8 else st[..., 1:]
            q = pool.index_select(0, slots)
            out.append(_dequantize(q, st[..., :1], low, self.bits).to(self.dtype))
        if self.channel_keys:
            out.insert(0, self.channel_keys[layer].read(slots))
        return out[0], out[1]
