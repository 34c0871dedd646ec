"""A contiguous KV cache stored in int8 or int4, with the newest tokens kept in float.

KIVI (Liu et al., 2024) and KVQuant (Hooper et al., 2024) observe that keys and values
survive low-bit storage when the few newest tokens stay exact. This cache keeps every
token's key and value quantized **per token** (int8: symmetric, ``amax / 127`` over the
head dimension; int4: asymmetric, min/max over the head dimension, two levels a byte)
and the last ``residual`` tokens also in float; :meth:`update` returns the keys and
values expanded to the model's dtype, the float window in place of its quantized copy.
KIVI quantizes keys per channel over groups of tokens; this cache quantizes keys per
token like the values (simpler and exact to roll back, since every slot stands alone).

It is a :class:`~attnlab.cache.DynamicKVCache` for everything the attention call needs
(the same slots, appended in order; cut back with ``length``), so every backend reads it.

Shape notation: ``B`` batch, ``H_kv`` heads, ``T`` slots, ``h_d`` head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.cache.base import Start, check_rows, tensor_nbytes
from attnlab.cache.kv_cache import DynamicKVCache, _int_start
from attnlab.functional.quant import pack_nibbles, unpack_nibbles

__all__ = ["KV_DTYPES", "QuantizedKVCache"]

KV_DTYPES = ("int8", "int4")


def _quantize(x: Tensor, bits: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """``[B, H, L, D]`` -> (levels, scales ``[B, H, L, 1]``, mins or None)."""
    x = x.float()
    if bits == 8:
        s = x.abs().amax(dim=-1, keepdim=True) / 127.0
        q = torch.round(x / s.clamp_min(1e-30)).clamp(-127, 127).to(torch.int8)
        return q, s, None
    lo, hi = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
    s = (hi - lo) / 15.0
    q = torch.round((x - lo) / s.clamp_min(1e-30)).clamp(0, 15).to(torch.uint8)
    b, h, n, d = q.shape
    return pack_nibbles(q.reshape(-1, d)).reshape(b, h, n, d // 2), s, lo


def _expand(q: Tensor, s: Tensor, m: Tensor | None, dtype: torch.dtype) -> Tensor:
    if m is None:
        return (q.float() * s).to(dtype)
    b, h, n, half = q.shape
    levels = unpack_nibbles(q.reshape(-1, half)).reshape(b, h, n, 2 * half)
    return (levels.float() * s + m).to(dtype)


class QuantizedKVCache(DynamicKVCache):
    """A growing KV cache held in ``kv_dtype`` (``"int8"`` or ``"int4"``), newest in float.

    Args:
        kv_dtype: ``"int8"`` or ``"int4"`` (head dims must be even).
        residual: how many of the newest tokens are also kept in float (0: none).
        capacity: slots to allocate at the first update.

    Raises:
        ValueError: an unknown ``kv_dtype`` or a negative ``residual``.
    """

    def __init__(self, *, kv_dtype: str = "int8", residual: int = 32, capacity: int = 0) -> None:
        super().__init__(capacity=capacity)
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {list(KV_DTYPES)}, got {kv_dtype!r}")
        if isinstance(residual, bool) or not isinstance(residual, int) or residual < 0:
            raise ValueError(f"residual must be an int >= 0, got {residual!r}")
        self.kv_dtype = kv_dtype
        self.bits = 8 if kv_dtype == "int8" else 4
        self.residual = residual
        self._store: dict[str, Tensor | None] = {}
        self._recent: tuple[Tensor, Tensor] | None = None  # float keys/values of the newest
        self._recent_start = 0

    def _buffers(self, key: Tensor, value: Tensor, need: int) -> None:
        """Allocate or grow the quantized buffers to ``need`` slots."""
        have = self._store.get("kq")
        size = max(need, self.capacity, 2 * (have.shape[2] if have is not None else 0))
        for name, x in (("k", key), ("v", value)):
            b, h, _, d = x.shape
            width = d if self.bits == 8 else d // 2
            qd = torch.int8 if self.bits == 8 else torch.uint8
            new = {
                f"{name}q": x.new_zeros((b, h, size, width), dtype=qd),
                f"{name}s": x.new_zeros((b, h, size, 1), dtype=torch.float32),
                f"{name}m": x.new_zeros((b, h, size, 1), dtype=torch.float32)
                if self.bits == 4
                else None,
            }
            for k, t in new.items():
                old = self._store.get(k)
                if t is not None and old is not None:
                    t[:, :, : self.length] = old[:, :, : self.length]
                self._store[k] = t

    def update(self, key: Tensor, value: Tensor, *, start: Start) -> tuple[Tensor, Tensor]:
        self.check_update(key, value)
        if self.bits == 4 and (key.shape[-1] % 2 or value.shape[-1] % 2):
            raise ValueError(
                f"an int4 KV cache needs even head dims, got {key.shape[-1]}, {value.shape[-1]}"
            )
        first = _int_start(start, "quantized cache")
        if first != self.length:
            raise ValueError(
                f"a growing cache appends: the next slot is {self.length}, got start={first}"
            )
        end = first + key.shape[2]
        kq = self._store.get("kq")
        if kq is None or kq.shape[2] < end:
            self._buffers(key, value, end)
        st = self._store
        for name, x in (("k", key), ("v", value)):
            q, s, m = _quantize(x, self.bits)
            st[f"{name}q"][:, :, first:end] = q  # type: ignore[index]
            st[f"{name}s"][:, :, first:end] = s  # type: ignore[index]
            if m is not None:
                st[f"{name}m"][:, :, first:end] = m  # type: ignore[index]
        self._keep_recent(key, value, first, end)
        self.length = end
        dtype = key.dtype
        k = _expand(st["kq"][:, :, :end], st["ks"][:, :, :end], self._m("km", end), dtype)  # type: ignore[index]
        v = _expand(st["vq"][:, :, :end], st["vs"][:, :, :end], self._m("vm", end), dtype)  # type: ignore[index]
        if self._recent is not None:
            r0 = self._recent_start
            k[:, :, r0:end] = self._recent[0]
            v[:, :, r0:end] = self._recent[1]
        self.k, self.v = k, v  # the expanded view of this step (not kept between steps)
        self.dtype = dtype
        return k, v

    def _m(self, name: str, end: int) -> Tensor | None:
        t = self._store.get(name)
        return None if t is None else t[:, :, :end]

    def _keep_recent(self, key: Tensor, value: Tensor, first: int, end: int) -> None:
        if self.residual == 0:
            self._recent = None
            return
        if self._recent is None or first < self._recent_start:
            rk, rv = key, value
            self._recent_start = first
        else:  # drop what a cut-back left stale, then append
            keep = first - self._recent_start
            rk = torch.cat([self._recent[0][:, :, :keep], key], dim=2)
            rv = torch.cat([self._recent[1][:, :, :keep], value], dim=2)
        over = rk.shape[2] - self.residual
        if over > 0:
            rk, rv = rk[:, :, over:], rv[:, :, over:]
            self._recent_start += over
        self._recent = (rk, rv)
        assert self._recent_start + rk.shape[2] == end

    def select(self, rows: Tensor) -> None:
        kq = self._store.get("kq")
        if kq is None:
            return
        rows = check_rows(rows, self.batch_size).to(kq.device)
        self._store = {
            k: (None if t is None else t.index_select(0, rows)) for k, t in self._store.items()
        }
        if self._recent is not None:
            self._recent = (
                self._recent[0].index_select(0, rows),
                self._recent[1].index_select(0, rows),
            )
        self.k = self.v = None
        self.batch_size = rows.numel()

    def nbytes(self) -> int:
        recent = self._recent if self._recent is not None else (None, None)
        return tensor_nbytes(*self._store.values(), *recent)

    def reset(self) -> None:
        super().reset()
        self._store = {}
        self._recent = None
        self._recent_start = 0
