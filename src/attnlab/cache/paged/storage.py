"""KV storage: the tensors of a paged KV cache, one key and one value pool per layer.

Shape notation: ``N`` blocks, ``bs`` block size, ``H_kv`` key/value heads, ``h_d`` key
head dim, ``h_v`` value head dim.

Layer ``i`` keeps ``keys[i] [N * bs, H_kv, h_d]`` and ``values[i] [N * bs, H_kv, h_v]``;
block ``b`` is the slots ``b * bs .. (b + 1) * bs - 1`` of every layer. Which block holds
what is the :class:`~attnlab.cache.paged.manager.KVManager`'s business; the storage only
writes slots, copies blocks (copy-on-write) and says how many bytes a block costs.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from attnlab.functional._checks import check_positive_int

__all__ = ["KVStorage"]


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

    Raises:
        ValueError: a size that is not a positive int.
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
    ) -> None:
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
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        self.keys = [
            torch.zeros(slots, num_kv_heads, head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]  # [N*bs, H_kv, h_d] each
        self.values = [
            torch.zeros(slots, num_kv_heads, vd, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]  # [N*bs, H_kv, h_v] each

    @property
    def device(self) -> torch.device:
        return self._device

    def bytes_per_block(self) -> int:
        """Bytes of one block over all layers (keys and values)."""
        per_slot = sum(
            k[0].numel() * k.element_size() + v[0].numel() * v.element_size()
            for k, v in zip(self.keys, self.values)
        )
        return per_slot * self.block_size

    def copy_blocks(self, copies: Iterable[tuple[int, int]]) -> None:
        """Copy block ``src`` onto block ``dst`` in every layer, for each ``(src, dst)``."""
        bs = self.block_size
        for old, new in copies:
            src, dst = slice(old * bs, (old + 1) * bs), slice(new * bs, (new + 1) * bs)
            for k, v in zip(self.keys, self.values):
                k[dst] = k[src]
                v[dst] = v[src]

    def write(self, layer: int, slots: Tensor, key: Tensor, value: Tensor) -> None:
        """Store ``key [n, H_kv, h_d]``/``value [n, H_kv, h_v]`` at pool ``slots [n]``.

        Raises:
            TypeError: keys of another dtype than the pool's.
        """
        kp, vp = self.keys[layer], self.values[layer]
        if key.dtype != kp.dtype:
            raise TypeError(f"keys are {key.dtype}, the paged pool holds {kp.dtype}")
        kp.index_copy_(0, slots, key)
        vp.index_copy_(0, slots, value)
