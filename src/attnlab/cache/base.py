"""The cache protocol: what a layer carries between decoding steps, and a model's set of them.

Shape notation: ``B`` batch, ``H_kv`` key/value heads, ``L`` new tokens, ``S`` keys
returned, ``h_d`` key head dim, ``h_v`` value head dim.

One protocol for every kind of per-layer state (docs/contracts.md, section 2):

* :class:`LayerCache`: ``length`` (slots written so far), :meth:`~LayerCache.reset`,
  :meth:`~LayerCache.select` (keep/reorder batch rows, for beam search and serving) and
  :meth:`~LayerCache.nbytes` (bytes held now; the cost model checks its KV-cache
  estimate against it). Recurrent states (Mamba's conv + SSM state, RWKV's sums) are
  layer caches too, with their own step method.
* :class:`KVCache`: a self-attention cache. :meth:`~KVCache.update` stores the new
  keys/values at explicit slots and returns the keys/values to attend to;
  :meth:`~KVCache.key_slots` says which slot each returned key holds (``[B or 1, S]``,
  ``-1`` for an empty entry), so a mask pattern is evaluated on (query slot, key slot)
  pairs wherever the keys live.
* :class:`ModelCache`: the per-layer caches of a model (possibly of different kinds, for
  hybrids) plus the cross-attention caches of an encoder-decoder.

A *slot* is a token's index in its row's decoded sequence, left padding included.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from attnlab.backends.plan import KVView

if TYPE_CHECKING:
    from attnlab.backends.plan import AttentionPlan

__all__ = ["CrossAttentionCache", "KVCache", "KVView", "LayerCache", "ModelCache", "Start"]

#: Where new tokens go: one slot for every row, or a long ``[B]`` tensor (one per row).
Start = int | Tensor


def check_rows(rows: object, batch_size: int | None) -> Tensor:
    """Validate the row index of :meth:`LayerCache.select`: a 1-D integer tensor within range."""
    if not isinstance(rows, Tensor):
        raise TypeError(f"rows must be a 1-D integer tensor, got {type(rows).__name__}")
    if rows.dim() != 1 or rows.dtype.is_floating_point or rows.dtype == torch.bool:
        raise ValueError(
            f"rows must be a 1-D integer tensor of batch rows, got {rows.dtype} {tuple(rows.shape)}"
        )
    if (
        batch_size is not None
        and rows.numel()
        and (int(rows.min()) < 0 or int(rows.max()) >= batch_size)
    ):
        raise ValueError(
            f"rows must lie in [0, batch_size={batch_size}), got range "
            f"[{int(rows.min())}, {int(rows.max())}]"
        )
    return rows.long()


def tensor_nbytes(*tensors: Tensor | None) -> int:
    """Bytes held by the given tensors (None counts 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class LayerCache(ABC):
    """Everything one layer carries between decoding steps.

    Attributes:
        length: slots written so far: the next token's slot (the maximum over rows for
            caches whose rows have their own lengths).
    """

    def __init__(self) -> None:
        self.length = 0

    def reset(self) -> None:
        """Forget every stored token (buffers may be kept for reuse)."""
        self.length = 0

    @abstractmethod
    def select(self, rows: Tensor) -> None:
        """Keep (and reorder) the batch rows ``rows`` (a long ``[B']`` index), in place.

        Beam search reorders its hypotheses with it; a server drops finished rows.
        """

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of tensor storage the cache holds now."""


class KVCache(LayerCache):
    """A self-attention cache of one layer. Slots are explicit (see the module docstring).

    The first :meth:`update` fixes the batch size, key/value head count and head dims;
    a later update that changes them raises ``ValueError`` (reset the cache, or make a
    new one, to store another model's keys).
    """

    def __init__(self) -> None:
        super().__init__()
        self.batch_size: int | None = None
        self.num_kv_heads: int | None = None
        self.head_dim: int | None = None
        self.value_dim: int | None = None
        self.dtype: torch.dtype | None = None

    @abstractmethod
    def key_slots(self, start: Start, num_new: int, device: torch.device | None = None) -> Tensor:
        """Slots of the keys that :meth:`update` returns for ``num_new`` tokens at ``start``.

        Returns:
            Long ``[B or 1, S]``; ``-1`` marks an empty entry (always masked).
        """

    @abstractmethod
    def update(self, key: Tensor, value: Tensor, *, start: Start) -> tuple[Tensor, Tensor]:
        """Store ``key [B, H_kv, L, h_d]``/``value [B, H_kv, L, h_v]`` at ``start..start+L-1``.

        Args:
            key: the new keys.
            value: the new values.
            start: the slot of the first new token: an int (every row), or a long
                ``[B]`` tensor (one slot per row), or a 0-d long tensor (a compiled
                step's explicit position).

        Returns:
            The keys and values to attend to, ``[B, H_kv, S, h_d]`` and
            ``[B, H_kv, S, h_v]``, in the order of :meth:`key_slots`.
        """

    def view(self, key: Tensor, value: Tensor, plan: AttentionPlan) -> KVView:
        """Store the new keys/values at ``plan.start`` and return what the plan attends to.

        The default: :meth:`update`'s tensors with the plan's key slots (the model
        computed them from :meth:`key_slots` once for its attention layers). A paged
        cache returns its pools and block tables when the plan's backend reads blocks.

        Args:
            key: ``[B, H_kv, L, h_d]`` the new keys.
            value: ``[B, H_kv, L, h_v]`` the new values.
            plan: the forward's attention plan.
        """
        k, v = self.update(key, value, start=plan.start)
        return KVView(k, v, plan.k_positions)

    def reset(self) -> None:
        super().reset()
        self.batch_size = self.num_kv_heads = self.head_dim = self.value_dim = None
        self.dtype = None

    def check_update(self, key: Tensor, value: Tensor) -> None:
        """Validate new keys/values against each other and against what the cache holds.

        Raises:
            TypeError: non-tensors, or non-floating keys/values.
            ValueError: wrong ranks, mismatched key/value shapes, a batch size, head
                count or head dim different from the earlier updates', or values too
                large for the cache's dtype (they would be stored as ``inf``).
        """
        if not isinstance(key, Tensor) or not isinstance(value, Tensor):
            raise TypeError(
                f"key and value must be tensors, got {type(key).__name__} and "
                f"{type(value).__name__}"
            )
        if key.dim() != 4 or value.dim() != 4 or key.shape[:3] != value.shape[:3]:
            raise ValueError(
                "key and value must be [batch, kv_heads, new_tokens, head_dim] with equal "
                f"leading dims, got {tuple(key.shape)} and {tuple(value.shape)}"
            )
        if not key.dtype.is_floating_point or not value.dtype.is_floating_point:
            raise TypeError(
                f"key and value must be floating tensors, got {key.dtype} and {value.dtype}"
            )
        b, h, _, d = key.shape
        dv = value.shape[3]
        if self.batch_size is None:
            self.batch_size = b
        if self.num_kv_heads is None:
            self.num_kv_heads, self.head_dim, self.value_dim = h, d, dv
        if b != self.batch_size:
            raise ValueError(
                f"batch size {b} does not match the cache's batch size {self.batch_size}; "
                "call reset() (or select(rows)) before changing the batch"
            )
        if (h, d, dv) != (self.num_kv_heads, self.head_dim, self.value_dim):
            raise ValueError(
                f"the cache holds {self.num_kv_heads} key/value heads of dims "
                f"{self.head_dim}/{self.value_dim}, got {h} heads of dims {d}/{dv}; a cache "
                "serves one layer of one model: call reset() or use a new cache"
            )
        if self.dtype is not None:
            for name, t in (("key", key), ("value", value)):
                check_fits_dtype(name, t, self.dtype)


def check_fits_dtype(name: str, t: Tensor, dtype: torch.dtype) -> None:
    """Raise ``ValueError`` when casting finite ``t`` to ``dtype`` would make infinities.

    Only a downcast can overflow, so the (host-syncing) check runs only then; a cache of
    the model's own dtype, as a compiled step uses, never pays for it.
    """
    if t.dtype == dtype or not dtype.is_floating_point:
        return
    limit = torch.finfo(dtype).max
    if torch.finfo(t.dtype).max <= limit or t.numel() == 0:
        return
    peak = t.detach().abs().nan_to_num(nan=0.0, posinf=0.0).amax()
    if float(peak) > limit:
        raise ValueError(
            f"{name} has values up to {float(peak):.4g}, beyond the cache's dtype {dtype} "
            f"(max {limit:.4g}): they would be stored as inf. Build the cache in "
            f"{t.dtype} (e.g. new_cache(..., dtype={t.dtype}))"
        )


class CrossAttentionCache(LayerCache):
    """The projected keys/values of the encoder output for one cross-attention layer.

    Filled by the first decoder step, reused by every later step (Vaswani et al., 2017,
    encoder-decoder attention). ``length`` is the encoder length once filled.
    """

    def __init__(self) -> None:
        super().__init__()
        self.key: Tensor | None = None
        self.value: Tensor | None = None

    @property
    def filled(self) -> bool:
        return self.key is not None

    def store(self, key: Tensor, value: Tensor) -> None:
        """Keep ``key``/``value`` ``[B, H_kv, S_enc, h_d]``."""
        if key.dim() != 4 or value.dim() != 4 or key.shape[:3] != value.shape[:3]:
            raise ValueError(
                "key and value must be [batch, kv_heads, encoder_len, head_dim] with equal "
                f"leading dims, got {tuple(key.shape)} and {tuple(value.shape)}"
            )
        self.key, self.value = key, value
        self.length = key.shape[2]

    def reset(self) -> None:
        super().reset()
        self.key = self.value = None

    def select(self, rows: Tensor) -> None:
        if self.key is None or self.value is None:
            return
        rows = check_rows(rows, self.key.shape[0]).to(self.key.device)
        self.key = self.key.index_select(0, rows)
        self.value = self.value.index_select(0, rows)

    def nbytes(self) -> int:
        return tensor_nbytes(self.key, self.value)


@dataclass
class ModelCache:
    """The caches of a whole model: ``past_key_values`` of attnlab models.

    Attributes:
        layers: one cache per layer, possibly of different kinds (a hybrid model mixes
            KV caches and recurrent states).
        cross: cross-attention caches, one per decoder layer of an encoder-decoder, or None.
    """

    layers: list[LayerCache]
    cross: list[CrossAttentionCache] | None = None

    @property
    def length(self) -> int:
        """Slots written so far (the next token's slot): the most over the layers."""
        return max((c.length for c in self.layers), default=0)

    @classmethod
    def build(
        cls, num_layers: int, make: Callable[[], LayerCache], *, cross: bool = False
    ) -> ModelCache:
        """``num_layers`` caches from the factory ``make`` (e.g. ``lambda: DynamicKVCache()``)."""
        return cls(
            layers=[make() for _ in range(num_layers)],
            cross=[CrossAttentionCache() for _ in range(num_layers)] if cross else None,
        )

    def _all(self) -> Iterable[LayerCache]:
        yield from self.layers
        yield from self.cross or []

    def reset(self) -> None:
        """Forget every stored token in every layer."""
        for c in self._all():
            c.reset()

    def select(self, rows: Tensor) -> None:
        """Keep (and reorder) the batch rows ``rows`` in every layer."""
        check_rows(rows, None)
        for c in self._all():
            c.select(rows)

    def nbytes(self) -> int:
        """Bytes held by every layer's cache."""
        return sum(c.nbytes() for c in self._all())

    def set_length(self, length: int) -> None:
        """Record that ``length`` slots are written in every layer.

        A compiled decode step writes its keys at a tensor position (no host sync, no
        Python side effect in the graph); the loop that calls it advances the lengths.
        """
        for c in self.layers:
            c.length = length
