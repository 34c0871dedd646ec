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

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from attnlab.cache.base import (
    CrossAttentionCache,
    KVCache,
    KVView,
    ModelCache,
    Start,
    check_rows,
    tensor_nbytes,
)

if TYPE_CHECKING:
    from attnlab.backends.plan import AttentionPlan

__all__ = [
    "CrossAttentionCache",
    "DynamicKVCache",
    "KVCache",
    "ModelCache",
    "SlidingWindowKVCache",
    "StaticKVCache",
]


def _int_start(start: Start, kind: str) -> int:
    """``start`` as one int for caches whose rows stay aligned (host sync for a tensor)."""
    if isinstance(start, Tensor):
        if start.dim() == 0:
            return int(start)
        first = int(start[0])
        if bool((start != first).any()):
            raise ValueError(
                f"a {kind} keeps every row at the same slot, got per-row starts "
                f"{start.tolist()}; use a StaticKVCache (or the paged cache) for rows of "
                "different lengths"
            )
        return first
    if isinstance(start, bool) or not isinstance(start, int):
        raise TypeError(f"start must be an int or a long tensor, got {type(start).__name__}")
    return start


class _TensorKVCache(KVCache):
    """A cache that holds its keys and values as ``k``/``v`` tensors ``[B, H_kv, T, h_d]``:
    row selection and byte counts, shared by the contiguous caches."""

    k: Tensor | None
    v: Tensor | None

    def select(self, rows: Tensor) -> None:
        if self.k is None or self.v is None:
            return
        rows = check_rows(rows, self.batch_size).to(self.k.device)
        self.k = self.k.index_select(0, rows)
        self.v = self.v.index_select(0, rows)
        self.batch_size = rows.numel()

    def nbytes(self) -> int:
        return tensor_nbytes(self.k, self.v)


class StaticKVCache(_TensorKVCache):
    """Preallocated contiguous cache with static shapes (gpt-fast style).

    Keys are written in place at explicit slots and the whole buffer is returned, so a
    compiled decode step sees the same shapes at every step; unwritten slots lie in the
    future of every query, so a causal pattern hides them. ``start`` may be a tensor (a
    0-d position, or one per row): the write is then an ``index_copy``/``index_put``
    without a host sync, and the caller advances ``length``
    (:meth:`~attnlab.cache.ModelCache.set_length`).

    Args:
        max_length: capacity ``T`` in slots.
        batch_size, num_kv_heads, head_dim, dtype, device: allocate now; when omitted,
            the buffers are allocated on the first :meth:`update` from its inputs.

    Raises:
        ValueError: an update past ``max_length`` ("cache too small"), or a batch size,
            head count or head dim different from the cache's.
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
            self._adopt_buffers()

    def _adopt_buffers(self) -> None:
        assert self.k is not None and self.v is not None
        self.batch_size, self.num_kv_heads, _, self.head_dim = self.k.shape
        self.value_dim = self.v.shape[3]
        self.dtype = self.k.dtype

    def key_slots(self, start: Start, num_new: int, device: torch.device | None = None) -> Tensor:
        return torch.arange(self.max_length, device=device)[None]  # [1, T]

    def update(self, key: Tensor, value: Tensor, *, start: Start) -> tuple[Tensor, Tensor]:
        self.check_update(key, value)
        n = key.shape[2]
        if not isinstance(start, Tensor):
            start = _int_start(start, "static cache")
            if start < 0 or start + n > self.max_length:
                raise ValueError(
                    f"cache too small: writing {n} token(s) at slot {start} needs {start + n} "
                    f"slots, the cache holds max_length={self.max_length}"
                )
        if self.k is None or self.v is None:
            shape = (key.shape[0], key.shape[1], self.max_length, key.shape[3])
            self.k = key.new_zeros(shape)
            self.v = value.new_zeros((*shape[:3], value.shape[3]))
            self._adopt_buffers()
        assert self.k is not None and self.v is not None
        if isinstance(start, int):
            self.k[:, :, start : start + n] = key
            self.v[:, :, start : start + n] = value
            self.length = max(self.length, start + n)
        elif start.dim() == 0:
            idx = start + torch.arange(n, device=key.device)  # [L]
            self.k.index_copy_(2, idx, key.to(self.k.dtype))
            self.v.index_copy_(2, idx, value.to(self.v.dtype))
        else:
            idx = start[:, None] + torch.arange(n, device=key.device)  # [B, L]
            rows = torch.arange(key.shape[0], device=key.device)[:, None]  # [B, 1]
            # Advanced indices around a slice put their dims first: [B, L, H_kv, h_d].
            self.k[rows, :, idx] = key.transpose(1, 2).to(self.k.dtype)
            self.v[rows, :, idx] = value.transpose(1, 2).to(self.v.dtype)
        return self.k, self.v

    def view(self, key: Tensor, value: Tensor, plan: AttentionPlan) -> KVView:
        """Store the new keys/values and return the first ``S`` slots the plan's call reads:
        every slot (``S = max_length``), or the prefix written so far when the step was
        given its key slots (``DecoderLM.decode_step(key_slots=...)``): a view, no copy."""
        k, v = self.update(key, value, start=plan.start)
        s = plan.call.key_shape[-2]
        return KVView(k[:, :, :s], v[:, :, :s], plan.k_positions)  # [B, H_kv, S, h_d]

    def reset(self) -> None:
        """Forget the tokens; the buffers (and their shapes) are kept for reuse."""
        self.length = 0


class DynamicKVCache(_TensorKVCache):
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

    def key_slots(self, start: Start, num_new: int, device: torch.device | None = None) -> Tensor:
        first = _int_start(start, "growing cache")
        return torch.arange(first + num_new, device=device)[None]  # [1, S]

    def _grow(self, key: Tensor, value: Tensor, need: int) -> None:
        size = max(need, self.capacity, 2 * (self.k.shape[2] if self.k is not None else 0))
        kd = key.dtype if self.k is None else self.k.dtype
        vd = value.dtype if self.v is None else self.v.dtype
        k = key.new_zeros((key.shape[0], key.shape[1], size, key.shape[3]), dtype=kd)
        v = value.new_zeros((value.shape[0], value.shape[1], size, value.shape[3]), dtype=vd)
        if self.k is not None and self.v is not None:
            k[:, :, : self.length] = self.k[:, :, : self.length]
            v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v
        self.dtype = k.dtype

    def update(self, key: Tensor, value: Tensor, *, start: Start) -> tuple[Tensor, Tensor]:
        self.check_update(key, value)
        first = _int_start(start, "growing cache")
        if first != self.length:
            raise ValueError(
                f"a growing cache appends: the next slot is {self.length}, got start={first}"
            )
        end = first + key.shape[2]
        if self.k is None or self.k.shape[2] < end:
            self._grow(key, value, end)
        assert self.k is not None and self.v is not None
        self.k[:, :, first:end] = key
        self.v[:, :, first:end] = value
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def reset(self) -> None:
        super().reset()
        self.k = self.v = None


class SlidingWindowKVCache(_TensorKVCache):
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

    def key_slots(self, start: Start, num_new: int, device: torch.device | None = None) -> Tensor:
        first = _int_start(start, "sliding-window cache")
        new = torch.arange(first, first + num_new, device=device)
        slots = new if self.slots is None else torch.cat((self.slots.to(new.device), new))
        return slots[None]  # [1, S]

    def update(self, key: Tensor, value: Tensor, *, start: Start) -> tuple[Tensor, Tensor]:
        self.check_update(key, value)
        first = _int_start(start, "sliding-window cache")
        if first != self.length:
            raise ValueError(
                f"a sliding-window cache appends: the next slot is {self.length}, got start={first}"
            )
        n = key.shape[2]
        slots = self.key_slots(first, n, key.device)[0]
        if self.k is not None and self.v is not None:
            key = torch.cat((self.k, key.to(self.k.dtype)), dim=2)  # [B, H_kv, n + L, h_d]
            value = torch.cat((self.v, value.to(self.v.dtype)), dim=2)
        self.k = key[:, :, -self.window :]
        self.v = value[:, :, -self.window :]
        self.dtype = self.k.dtype
        self.slots = slots[-self.window :]
        self.length = first + n
        return key, value

    def reset(self) -> None:
        super().reset()
        self.k = self.v = self.slots = None

    def nbytes(self) -> int:
        return tensor_nbytes(self.k, self.v, self.slots)
