"""A contiguous KV cache stored in int8, int4 or int2, the newest tokens kept in float (KIVI).

KIVI (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache",
arXiv:2402.02750) observes that keys have a few outlier *channels* (the same channels
large in every token), values do not: so keys are quantized **per channel** over groups
of ``G`` tokens (one scale and zero point per channel per group), values **per token**
(one scale and zero point per token over the head dimension), and the newest tokens stay
in full precision (the "residual": a partial key group cannot be quantized per channel
yet, and the newest tokens matter most).

This cache does that. Stored layout, per layer (``B`` batch, ``H_kv`` heads, ``T`` slots,
``D`` head dim, ``b`` bits):

* levels: ``[B, H_kv, T, D * b / 8]`` bytes (int8 signed; int4/int2 unsigned levels packed
  along the head dim, lowest bits first);
* keys per channel: scales/mins ``[B, H_kv, T / G, D]`` (float32), one row per token group;
* keys per token (``key_mode="token"``, KIVI's baseline) and values: scales/mins
  ``[B, H_kv, T, 1]``;
* the float window: the newest tokens, ``[B, H_kv, n, D]``, ``residual <= n < residual + G``
  for keys per channel (whole groups leave it), ``n = min(residual, T)`` otherwise.

int8 is symmetric (``x ~ s * q``, ``s = amax / 127``), int4/int2 asymmetric
(``x ~ s * q + m``, ``s = (max - min) / (2^b - 1)``), rounded to nearest.
:meth:`update` returns keys and values expanded to the model's dtype (the window as it
came), so every attention backend reads this cache.

A cut-back (``length`` set lower, as speculative decoding does) keeps what is stored; a
key group cut in the middle is expanded back into the float window (its stored
approximation, never re-rounded).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnlab.cache.base import Start, check_rows, tensor_nbytes
from attnlab.cache.kv_cache import DynamicKVCache, _int_start

__all__ = [
    "KEY_MODES",
    "KV_DTYPES",
    "QuantizedKVCache",
    "kv_bytes_per_token",
    "quantize_model_cache",
]

#: Storage kinds and their bits.
KV_DTYPES = ("int8", "int4", "int2")
KEY_MODES = ("channel", "token")
_BITS = {"int8": 8, "int4": 4, "int2": 2}


def kv_bytes_per_token(
    kv_dtype: str, head_dim: int, *, key_mode: str = "channel", group: int = 32
) -> float:
    """Stored bytes of one token's key and value in one head (levels, scales, zero points).

    The float window (a constant number of tokens per layer) is not included.
    """
    bits = _BITS[kv_dtype]
    stat = 4 if bits == 8 else 8  # float32 scale (+ float32 min when asymmetric)
    key_stats = stat * head_dim / group if key_mode == "channel" else stat
    return 2 * head_dim * bits / 8 + key_stats + stat


def _pack(q: Tensor, bits: int) -> Tensor:
    """uint8 levels ``[..., D]`` -> bytes ``[..., D * bits / 8]`` (lowest bits first)."""
    per = 8 // bits
    q = q.reshape(*q.shape[:-1], q.shape[-1] // per, per)
    out = q[..., 0].clone()
    for i in range(1, per):
        out |= q[..., i] << (bits * i)
    return out


def _unpack(p: Tensor, bits: int) -> Tensor:
    """Inverse of :func:`_pack`: bytes ``[..., W]`` -> levels ``[..., W * 8 / bits]``."""
    per = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=p.device)
    q = (p[..., None] >> shifts) & ((1 << bits) - 1)
    return q.reshape(*p.shape[:-1], p.shape[-1] * per)


def _quantize(x: Tensor, bits: int, dim: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """Quantize ``x`` with one scale (and zero point) per slice along ``dim``.

    Returns (levels ``x``'s shape, packed along the last dim, scales and mins with ``dim``
    kept as size 1, mins None for int8).
    """
    x = x.float()
    if bits == 8:
        s = x.abs().amax(dim=dim, keepdim=True) / 127.0
        q = torch.round(x / s.clamp_min(1e-30)).clamp(-127, 127).to(torch.int8)
        return q, s, None
    top = (1 << bits) - 1
    lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    s = (hi - lo) / top
    q = torch.round((x - lo) / s.clamp_min(1e-30)).clamp(0, top).to(torch.uint8)
    return _pack(q, bits), s, lo


def _dequantize(q: Tensor, s: Tensor, m: Tensor | None, bits: int) -> Tensor:
    """Levels and broadcastable scales/mins -> float32 values."""
    if bits == 8:
        return q.float() * s
    assert m is not None
    return _unpack(q, bits).float() * s + m


class _Stream:
    """One quantized tensor (keys or values) of one layer: stored prefix + float window.

    ``group`` tokens share one scale per channel (``per_channel``) or each token has one
    scale over the head dim (``group == 1``).
    """

    def __init__(self, *, bits: int, per_channel: bool, group: int, residual: int) -> None:
        self.bits, self.per_channel, self.residual = bits, per_channel, residual
        self.group = group if per_channel else 1
        self.q: Tensor | None = None  # [B, H, cap, D*bits/8]
        self.s: Tensor | None = None  # [B, H, cap/G, D] or [B, H, cap, 1]
        self.m: Tensor | None = None  # like s (asymmetric only)
        self.stored = 0  # slots [0, stored) are quantized; a multiple of group
        self.tail: Tensor | None = None  # float [B, H, n, D]: slots [stored, stored + n)

    def _ensure(self, like: Tensor, need: int, capacity: int) -> None:
        have = 0 if self.q is None else self.q.shape[2]
        if need <= have:
            return
        g = self.group
        size = -(-max(need, capacity, 2 * have) // g) * g
        b, h, _, d = like.shape
        width = d * self.bits // 8
        qd = torch.int8 if self.bits == 8 else torch.uint8
        stat = (b, h, size // g, d) if self.per_channel else (b, h, size, 1)
        new_q = like.new_zeros((b, h, size, width), dtype=qd)
        new_s = like.new_zeros(stat, dtype=torch.float32)
        new_m = like.new_zeros(stat, dtype=torch.float32) if self.bits < 8 else None
        if self.q is not None and self.s is not None:
            n, ns = self.stored, self.stored // g
            new_q[:, :, :n] = self.q[:, :, :n]
            new_s[:, :, :ns] = self.s[:, :, :ns]
            if new_m is not None and self.m is not None:
                new_m[:, :, :ns] = self.m[:, :, :ns]
        self.q, self.s, self.m = new_q, new_s, new_m

    def _store(self, x: Tensor, capacity: int) -> None:
        """Quantize ``x [B, H, n, D]`` (``n`` a multiple of the group) at slot ``stored``."""
        n, g = x.shape[2], self.group
        first = self.stored
        self._ensure(x, first + n, capacity)
        assert self.q is not None and self.s is not None
        if self.per_channel:
            b, h, _, d = x.shape
            q, s, m = _quantize(x.reshape(b, h, n // g, g, d), self.bits, dim=3)
            q = q.reshape(b, h, n, -1)
            s, m = s[:, :, :, 0], (None if m is None else m[:, :, :, 0])  # [B, H, n/G, D]
        else:
            q, s, m = _quantize(x, self.bits, dim=-1)
        self.q[:, :, first : first + n] = q
        self.s[:, :, first // g : (first + n) // g] = s
        if m is not None and self.m is not None:
            self.m[:, :, first // g : (first + n) // g] = m
        self.stored = first + n

    def expand_stored(self, end: int) -> Tensor:
        """Float32 ``[B, H, end, D]`` of the stored slots ``[0, end)``."""
        assert self.q is not None and self.s is not None
        g = self.group
        groups = -(-end // g)
        q = self.q[:, :, : groups * g]
        s = self.s[:, :, :groups]
        m = None if self.m is None else self.m[:, :, :groups]
        if self.per_channel:
            b, h, n, w = q.shape
            q = q.reshape(b, h, groups, g, w)
            s, m = s[:, :, :, None], (None if m is None else m[:, :, :, None])
            x = _dequantize(q, s, m, self.bits).reshape(b, h, n, -1)
        else:
            x = _dequantize(q, s, m, self.bits)
        return x[:, :, :end]

    def append(self, x: Tensor, first: int, capacity: int) -> None:
        """Write ``x [B, H, L, D]`` at slot ``first`` (``<=`` the written length)."""
        if first < self.stored:  # a cut-back into the stored part
            g0 = first // self.group * self.group
            kept = self.expand_stored(first)[:, :, g0:].to(x.dtype)
            self.stored = g0
            self.tail = kept
        elif self.tail is not None:
            self.tail = self.tail[:, :, : first - self.stored]
        tail = x if self.tail is None or self.tail.shape[2] == 0 else torch.cat([self.tail, x], 2)
        n = tail.shape[2]
        over = (n - self.residual) // self.group * self.group
        if over > 0:
            self._store(tail[:, :, :over], capacity)
            tail = tail[:, :, over:]
        self.tail = tail

    def expand(self, dtype: torch.dtype) -> Tensor:
        """Every written slot, ``[B, H, stored + n, D]`` in ``dtype``."""
        assert self.tail is not None
        if self.stored == 0:
            return self.tail.to(dtype)
        return torch.cat([self.expand_stored(self.stored).to(dtype), self.tail.to(dtype)], 2)

    def select(self, rows: Tensor) -> None:
        for name in ("q", "s", "m", "tail"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, rows.to(t.device)))

    def nbytes(self) -> int:
        return tensor_nbytes(self.q, self.s, self.m, self.tail)


class QuantizedKVCache(DynamicKVCache):
    """A growing KV cache held in ``kv_dtype``, keys per channel and values per token (KIVI).

    Args:
        kv_dtype: ``"int8"``, ``"int4"`` or ``"int2"`` (head dims divisible by 8 / bits).
        key_mode: ``"channel"`` (KIVI: one scale per channel per group of ``group`` tokens)
            or ``"token"`` (one scale per token over the head dim, like the values).
        group: tokens per key group in ``"channel"`` mode.
        residual: how many of the newest tokens stay in float at least (0: none; keys per
            channel keep up to ``group - 1`` more, the partial group).
        capacity: slots to allocate at the first quantized write.

    Raises:
        ValueError: an unknown ``kv_dtype`` or ``key_mode``, a ``group`` below 1 or a
            negative ``residual``; at update, a head dim the bits do not pack.
    """

    def __init__(
        self,
        *,
        kv_dtype: str = "int8",
        key_mode: str = "channel",
        group: int = 32,
        residual: int = 32,
        capacity: int = 0,
    ) -> None:
        super().__init__(capacity=capacity)
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {list(KV_DTYPES)}, got {kv_dtype!r}")
        if key_mode not in KEY_MODES:
            raise ValueError(f"key_mode must be one of {list(KEY_MODES)}, got {key_mode!r}")
        for name, value, low in (("group", group, 1), ("residual", residual, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        self.kv_dtype, self.key_mode = kv_dtype, key_mode
        self.bits = _BITS[kv_dtype]
        self.group, self.residual = group, residual
        self._new_streams()

    def _new_streams(self) -> None:
        kw = {"bits": self.bits, "residual": self.residual, "group": self.group}
        self._k = _Stream(per_channel=self.key_mode == "channel", **kw)
        self._v = _Stream(per_channel=False, **kw)

    def update(self, key: Tensor, value: Tensor, *, start: Start) -> tuple[Tensor, Tensor]:
        self.check_update(key, value)
        per = 8 // self.bits
        if key.shape[-1] % per or value.shape[-1] % per:
            raise ValueError(
                f"a {self.kv_dtype} KV cache packs {per} levels a byte: head dims must be "
                f"multiples of {per}, got {key.shape[-1]} and {value.shape[-1]}"
            )
        first = _int_start(start, "quantized cache")
        if first != self.length:
            raise ValueError(
                f"a growing cache appends: the next slot is {self.length}, got start={first}"
            )
        self._k.append(key, first, self.capacity)
        self._v.append(value, first, self.capacity)
        self.length = first + key.shape[2]
        self.dtype = key.dtype
        k, v = self._k.expand(key.dtype), self._v.expand(value.dtype)
        self.k, self.v = k, v  # the expanded view of this step (not kept between steps)
        return k, v

    def select(self, rows: Tensor) -> None:
        if self._k.tail is None:
            return
        rows = check_rows(rows, self.batch_size)
        self._k.select(rows)
        self._v.select(rows)
        self.k = self.v = None
        self.batch_size = rows.numel()

    def nbytes(self) -> int:
        """Bytes held between steps: the stored levels, scales, zero points and the window."""
        return self._k.nbytes() + self._v.nbytes()

    def reset(self) -> None:
        super().reset()
        self._new_streams()


def quantize_model_cache(cache: Any, **settings: Any) -> Any:
    """Replace every growing KV layer of a fresh model cache with a :class:`QuantizedKVCache`.

    Args:
        cache: a model cache (``model.new_cache()``) whose layers are
            :class:`~attnlab.cache.DynamicKVCache`, none holding tokens yet.
        **settings: :class:`QuantizedKVCache`'s arguments (``kv_dtype``, ``key_mode``, ...).

    Returns:
        The same cache object.

    Raises:
        ValueError: a layer of another kind (static, paged, recurrent state, window) or a
            cache that already holds tokens; bad settings.
    """
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"cache must be a model cache with .layers, got {type(cache).__name__}")
    kinds = sorted({type(c).__name__ for c in layers if type(c) is not DynamicKVCache})
    if kinds:
        raise ValueError(
            f"a quantized KV cache replaces growing KV caches; this cache's layers carry {kinds}"
        )
    if any(c.length for c in layers):
        raise ValueError("quantize_model_cache needs a fresh cache; this one holds tokens")
    capacity = settings.pop("capacity", None)
    cache.layers = [
        QuantizedKVCache(capacity=c.capacity if capacity is None else capacity, **settings)
        for c in layers
    ]
    return cache
