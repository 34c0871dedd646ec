"""Key/value caches for autoregressive decoding, with explicit positions.

Shape notation: ``B`` batch, ``H_kv`` key/value heads, ``L`` new tokens, ``S`` keys
returned, ``h_d`` head dim, ``T`` capacity.

A *slot* is a token's index in the decoded sequence (prompt, padding included, then
the generated tokens): the ``L`` tokens of a call occupy slots ``start .. start+L-1``.
Each self-attention cache stores keys/values by slot and says, with
:meth:`KVCache.key_slots`, which slot each returned key holds, so the caller can build
a causal mask aligned bottom-right (query slot ``q`` sees key slots ``<= q``) for any
cache layout, and look up padding by slot.

* :class:`StaticKVCache`: preallocated ``[B, H_kv, T, h_d]`` buffers, written in place
  at explicit positions, always returned whole: static shapes for ``torch.compile``
  (unwritten slots lie in the future of every query, so a causal mask hides them).
* :class:`DynamicKVCache`: a contiguous buffer that grows (doubling) and returns the
  written prefix: the fast choice in eager mode.
* :class:`SlidingWindowKVCache`: keeps the last ``window`` slots only; memory is
  bounded by the window (Mistral; Beltagy et al., 2020; Jiang et al., 2023).
* :class:`CrossAttentionCache`: the projected keys/values of the encoder output,
  computed once per sequence (Vaswani et al., 2017, encoder-decoder attention).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "CrossAttentionCache",
    "DynamicKVCache",
    "KVCache",
    "ModelCache",
    "SlidingWindowKVCache",
    "StaticKVCache",
]


def _check_kv(key: Tensor, value: Tensor) -> None:
    if key.dim() != 4 or value.dim() != 4 or key.shape[:3] != value.shape[:3]:
        raise ValueError(
            "key and value must be [batch, kv_heads, new_tokens, head_dim] with equal leading dims, "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )


class KVCache(ABC):
    """A self-attention cache of one layer. Slots are explicit (see the module docstring)."""

    def __init__(self) -> None:
        self.length = 0  # slots written: the next token's slot
        self.batch_size: int | None = None

    def _check_batch(self, key: Tensor) -> None:
        if self.batch_size is None:
            self.batch_size = key.shape[0]
        elif key.shape[0] != self.batch_size:
            raise ValueError(
                f"batch size {key.shape[0]} does not match the cache's batch size {self.batch_size}"
            )

    @abstractmethod
    def key_slots(self, start: int, num_new: int, device: torch.device | None = None) -> Tensor:
        """Slots of the keys that :meth:`update` will return for ``num_new`` tokens at ``start``.

        Returns:
            Long ``[S]``; ``-1`` marks an empty entry (to be masked).
        """

    @abstractmethod
    def update(self, key: Tensor, value: Tensor, *, start: int) -> tuple[Tensor, Tensor]:
        """Store ``key``/``value`` ``[B, H_kv, L, h_d]`` at slots ``start..start+L-1``.

        Returns:
            The keys and values to attend to, ``[B, H_kv, S, h_d]``, in the order of
            :meth:`key_slots`.
        """

    def reset(self) -> None:
        """Forget every stored token (buffers may be kept for reuse)."""
        self.length = 0


class StaticKVCache(KVCache):
    """Preallocated contiguous cache with static shapes (gpt-fast style).

    Args:
        max_length: capacity ``T`` in slots.
        batch_size, num_kv_heads, head_dim, dtype, device: allocate now; when omitted,
            the buffers are allocated on the first :meth:`update` from its inputs.

    Raises:
        ValueError: an update past ``max_length`` ("cache too small"), or a batch size
            different from the cache's.
    """

    def __init__(
        self,
        *,
        max_length: int,
        batch_size: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= 0:
            raise ValueError(f"max_length must be a positive int, got {max_length!r}")
        self.max_length = max_length
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        if batch_size is not None and num_kv_heads is not None and head_dim is not None:
            shape = (batch_size, num_kv_heads, max_length, head_dim)
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
            self.batch_size = batch_size

    def key_slots(self, start: int, num_new: int, device: torch.device | None = None) -> Tensor:
        return torch.arange(self.max_length, device=device)

    def update(self, key: Tensor, value: Tensor, *, start: int) -> tuple[Tensor, Tensor]:
        _check_kv(key, value)
        self._check_batch(key)
        n = key.shape[2]
        if start < 0 or start + n > self.max_length:
            raise ValueError(
                f"cache too small: writing {n} token(s) at slot {start} needs {start + n} slots, "
                f"the cache holds max_length={self.max_length}"
            )
        if self.k is None or self.v is None:
            shape = (key.shape[0], key.shape[1], self.max_length, key.shape[3])
            self.k = key.new_zeros(shape)
            self.v = value.new_zeros((*shape[:3], value.shape[3]))
        self.k[:, :, start : start + n] = key
        self.v[:, :, start : start + n] = value
        self.length = max(self.length, start + n)
        return self.k, self.v


class DynamicKVCache(KVCache):
    """Contiguous cache that grows as tokens arrive and returns the written prefix.

    Args:
        capacity: slots to preallocate on the first update (it doubles when exceeded);
            generation passes prompt length + ``max_new_tokens`` so it never reallocates.
    """

    def __init__(self, *, capacity: int = 0) -> None:
        super().__init__()
        self.capacity = capacity
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def key_slots(self, start: int, num_new: int, device: torch.device | None = None) -> Tensor:
        return torch.arange(start + num_new, device=device)

    def _grow(self, key: Tensor, value: Tensor, need: int) -> None:
        size = max(need, self.capacity, 2 * (self.k.shape[2] if self.k is not None else 0))
        k = key.new_zeros((key.shape[0], key.shape[1], size, key.shape[3]))
        v = value.new_zeros((value.shape[0], value.shape[1], size, value.shape[3]))
        if self.k is not None and self.v is not None:
            k[:, :, : self.length] = self.k[:, :, : self.length]
            v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v

    def update(self, key: Tensor, value: Tensor, *, start: int) -> tuple[Tensor, Tensor]:
        _check_kv(key, value)
        self._check_batch(key)
        if start != self.length:
            raise ValueError(
                f"a growing cache appends: the next slot is {self.length}, got start={start}"
            )
        end = start + key.shape[2]
        if self.k is None or self.k.shape[2] < end:
            self._grow(key, value, end)
        assert self.k is not None and self.v is not None
        self.k[:, :, start:end] = key
        self.v[:, :, start:end] = value
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class SlidingWindowKVCache(KVCache):
    """Rolling cache that keeps only the keys/values of the last ``window`` slots.

    A query at slot ``q`` of a model with window ``W`` sees slots ``q-W+1 .. q``, so
    older entries are never needed again. Memory is ``O(W)`` per layer; a call with
    ``L`` new tokens briefly holds ``W + L`` entries.

    Args:
        window: number of slots kept (Mistral's ``sliding_window``).
    """

    def __init__(self, *, window: int) -> None:
        super().__init__()
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise ValueError(f"window must be a positive int, got {window!r}")
        self.window = window
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.slots: Tensor | None = None  # [n <= window]

    def key_slots(self, start: int, num_new: int, device: torch.device | None = None) -> Tensor:
        new = torch.arange(start, start + num_new, device=device)
        return new if self.slots is None else torch.cat((self.slots.to(new.device), new))

    def update(self, key: Tensor, value: Tensor, *, start: int) -> tuple[Tensor, Tensor]:
        _check_kv(key, value)
        self._check_batch(key)
        if start != self.length:
            raise ValueError(
                f"a sliding-window cache appends: the next slot is {self.length}, got start={start}"
            )
        n = key.shape[2]
        slots = self.key_slots(start, n, key.device)
        if self.k is not None and self.v is not None:
            key = torch.cat((self.k, key), dim=2)  # [B, H_kv, n + L, h_d]
            value = torch.cat((self.v, value), dim=2)
        self.k = key[:, :, -self.window :]
        self.v = value[:, :, -self.window :]
        self.slots = slots[-self.window :]
        self.length = start + n
        return key, value

    def reset(self) -> None:
        super().reset()
        self.k = self.v = self.slots = None


class CrossAttentionCache:
    """The projected keys/values of the encoder output for one cross-attention layer.

    Filled by the first decoder step, reused by every later step.
    """

    def __init__(self) -> None:
        self.key: Tensor | None = None
        self.value: Tensor | None = None

    @property
    def filled(self) -> bool:
        return self.key is not None

    def store(self, key: Tensor, value: Tensor) -> None:
        """Keep ``key``/``value`` ``[B, H_kv, S_enc, h_d]``."""
        _check_kv(key, value)
        self.key, self.value = key, value

    def reset(self) -> None:
        self.key = self.value = None


@dataclass
class ModelCache:
    """The caches of a whole model: one per layer, plus cross-attention caches for a decoder
    of an encoder-decoder. ``past_key_values`` of attnlab models.

    Attributes:
        layers: self-attention caches, one per layer.
        cross: cross-attention caches, one per layer, or None.
    """

    layers: list[KVCache]
    cross: list[CrossAttentionCache] | None = None

    @property
    def length(self) -> int:
        """Slots written so far (the next token's slot)."""
        return self.layers[0].length if self.layers else 0

    @classmethod
    def build(
        cls, num_layers: int, make: Callable[[], KVCache], *, cross: bool = False
    ) -> ModelCache:
        """``num_layers`` caches from the factory ``make`` (e.g. ``lambda: DynamicKVCache()``)."""
        return cls(
            layers=[make() for _ in range(num_layers)],
            cross=[CrossAttentionCache() for _ in range(num_layers)] if cross else None,
        )

    def reset(self) -> None:
        for c in self.layers:
            c.reset()
        for x in self.cross or []:
            x.reset()
