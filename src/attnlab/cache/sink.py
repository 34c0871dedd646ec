"""Attention sinks: a window of recent keys plus the first few tokens (StreamingLLM).

Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks"
(arXiv:2309.17453): a trained decoder puts a large share of its attention on the first
tokens whatever they say; a plain window cache evicts them and perplexity explodes, while
keeping the first ``sinks`` tokens beside the ``window`` most recent ones keeps it close
to recomputing the window from scratch, at a fixed memory.

Shape notation: ``B`` batch, ``H_kv`` key/value heads, ``L`` new tokens, ``h_d`` head dim.

Positions. The paper gives tokens their positions *within the cache*, so that the query's
distance to a sink never exceeds the cache size. attnlab's attention rotates keys before
they reach the cache, at the slot the model gives them (the absolute position). RoPE
scores depend only on the distance between query and key, so the recent keys are already
at the right distances; only the sinks are not. This cache keeps the sinks' keys as they
were rotated (positions ``0 .. sinks-1``) and, at every call, returns them rotated
further by the number ``E`` of tokens evicted so far: the query then sees sink ``j`` at
distance ``i_q - j``, with ``i_q`` its index in the cache, exactly as in the paper. Each
call rotates from the stored original, so no rounding accumulates. The pattern sees the
same slots: the sinks at ``j + E``, the recent keys at their own slots.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnlab._validate import check_int
from attnlab.cache.base import KVCache, Start, check_rows, tensor_nbytes
from attnlab.functional.positions import apply_rope, rope_angles

__all__ = ["SinkKVCache"]


class SinkKVCache(KVCache):
    """A window of the ``window`` newest tokens plus the first ``sinks`` tokens of the stream.

    A query attends to at most ``sinks + window`` keys, itself included. Memory is fixed:
    ``sinks + window - 1`` entries per layer between calls.

    Args:
        window: recent tokens each query attends to (itself included), >= 1.
        sinks: first tokens kept for ever (the paper keeps 4); 0 gives a plain window.
        rotary: the layer's :class:`~attnlab.modules.positions.RotaryEmbedding` (to move
            the sinks to their positions within the cache), or None for layers without
            RoPE (ALiBi and NoPE layers read the slots, which move with the sinks).

    Raises:
        ValueError: bad counts, or a rotary embedding whose angles depend on the sequence
            length (dynamic NTK), which a constant shift cannot express.
    """

    def __init__(self, *, window: int, sinks: int = 4, rotary: nn.Module | None = None) -> None:
        super().__init__()
        self.window = check_int("window", window, min_value=1)
        self.sinks = check_int("sinks", sinks, min_value=0)
        if rotary is not None and getattr(rotary, "rope_type", "default") == "dynamic":
            raise ValueError(
                "a sink cache shifts the sinks' RoPE angles by a constant; dynamic NTK "
                "scaling changes them with the sequence length: use a static rope_type"
            )
        self.rotary = rotary
        self.evicted = 0  # tokens dropped from between the sinks and the window
        self.sink_k: Tensor | None = None  # [B, H_kv, <=sinks, h_d], rotated at 0..sinks-1
        self.sink_v: Tensor | None = None
        self.k: Tensor | None = None  # [B, H_kv, <=window-1, h_d], the newest tokens
        self.v: Tensor | None = None

    @property
    def capacity(self) -> int:
        """Keys a query attends to at most: ``sinks + window``."""
        return self.sinks + self.window

    def _counts(self) -> tuple[int, int]:
        ns = 0 if self.sink_k is None else self.sink_k.shape[2]
        nr = 0 if self.k is None else self.k.shape[2]
        return ns, nr

    def _check_start(self, start: Start, num_new: int) -> int:
        if isinstance(start, Tensor):
            if start.dim() != 0:
                raise ValueError(
                    "a sink cache keeps one layout for every row: start must be an int, "
                    f"got a tensor of shape {tuple(start.shape)}"
                )
            start = int(start)
        if start != self.length:
            raise ValueError(
                f"a sink cache appends: the next slot is {self.length}, got start={start}"
            )
        ns, nr = self._counts()
        to_sinks = min(self.sinks - ns, num_new)
        if nr + num_new - to_sinks > self.window:
            # the last query of this call would see more than `window` recent keys
            raise ValueError(
                f"a sink cache with window={self.window} takes at most "
                f"{self.window - nr + to_sinks} new tokens now (it holds {nr} recent ones), "
                f"got {num_new}: feed long text in chunks, token by token once full"
            )
        return start

    def key_slots(self, start: Start, num_new: int, device: torch.device | None = None) -> Tensor:
        first = self._check_start(start, num_new)
        ns, nr = self._counts()
        sink = torch.arange(ns, device=device) + self.evicted
        recent = torch.arange(first - nr, first + num_new, device=device)
        return torch.cat((sink, recent))[None]  # [1, ns + nr + L]

    def _shifted_sinks(self) -> Tensor | None:
        if self.sink_k is None or self.rotary is None or self.evicted == 0:
            return self.sink_k
        rotary: Any = self.rotary
        pos = torch.full((self.sink_k.shape[2],), self.evicted, device=self.sink_k.device)
        cos, sin = rope_angles(pos, rotary.inv_freq.to(pos.device))  # a pure rotation
        shifted = apply_rope(self.sink_k.float(), cos, sin, convention=rotary.convention)
        return shifted.to(self.sink_k.dtype)

    def update(self, key: Tensor, value: Tensor, *, start: Start) -> tuple[Tensor, Tensor]:
        self.check_update(key, value)
        first = self._check_start(start, key.shape[2])
        ns, _ = self._counts()
        sink_k, sink_v = self._shifted_sinks(), self.sink_v
        parts_k = [t for t in (sink_k, self.k, key) if t is not None]
        parts_v = [t for t in (sink_v, self.v, value) if t is not None]
        all_k = torch.cat(parts_k, dim=2)  # [B, H_kv, ns + nr + L, h_d]
        all_v = torch.cat(parts_v, dim=2)
        # New tokens fill the sinks first (unshifted: nothing is evicted before they fill).
        take = min(self.sinks - ns, key.shape[2])
        if take:
            add_k, add_v = key[:, :, :take], value[:, :, :take]
            self.sink_k = add_k if self.sink_k is None else torch.cat((self.sink_k, add_k), 2)
            self.sink_v = add_v if self.sink_v is None else torch.cat((self.sink_v, add_v), 2)
        rest_k = [t for t in (self.k, key[:, :, take:]) if t is not None]
        rest_v = [t for t in (self.v, value[:, :, take:]) if t is not None]
        recent_k = torch.cat(rest_k, dim=2)
        recent_v = torch.cat(rest_v, dim=2)
        keep = self.window - 1
        drop = max(0, recent_k.shape[2] - keep)
        self.evicted += drop
        self.k = recent_k[:, :, drop:]
        self.v = recent_v[:, :, drop:]
        self.dtype = all_k.dtype
        self.length = first + key.shape[2]
        return all_k, all_v

    def reset(self) -> None:
        super().reset()
        self.evicted = 0
        self.sink_k = self.sink_v = self.k = self.v = None

    def select(self, rows: Tensor) -> None:
        rows = check_rows(rows, self.batch_size)
        for name in ("sink_k", "sink_v", "k", "v"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, rows.to(t.device)))
        if self.batch_size is not None:
            self.batch_size = int(rows.numel())

    def nbytes(self) -> int:
        return tensor_nbytes(self.sink_k, self.sink_v, self.k, self.v)
