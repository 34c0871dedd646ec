"""One layer's view of a :class:`~attnlab.cache.paged.pool.PagedKVPool`: the cache protocol.

Shape notation: ``B`` rows, ``H_kv`` key/value heads, ``L`` input positions of the
step, ``T`` virtual slots of the step, ``h_d`` head dim.

A :class:`PagedKVCache` is a :class:`~attnlab.cache.KVCache` like the contiguous
caches, so every decoder (GPT-2, Llama, Mistral with its window, BLOOM) runs on it
through its one forward: :meth:`update` writes the step's new keys/values into this
layer's pool at the slots the block tables give, and returns every row's keys/values
gathered through its block table in the step's left-padded layout (the gather-based
reference path of PagedAttention, Kwon et al., 2023). A pool stored in int8/int4
(:class:`~attnlab.cache.paged.storage.KVStorage`) is dequantized in that gather, and its
layers report ``block_size == 0`` so that no plan hands its levels to a backend that
reads the pools directly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from attnlab.backends.plan import KVView
from attnlab.cache.base import KVCache, Start

if TYPE_CHECKING:
    from attnlab.backends.plan import AttentionPlan, BlockTable
    from attnlab.cache.paged.pool import PagedKVPool, SeqId, StepBatch

__all__ = ["PagedKVCache"]


class PagedKVCache(KVCache):
    """Layer ``layer`` of a paged pool; built by :class:`PagedKVPool`, not directly.

    Used two ways:

    * by the serving engine, which lays out each step with
      :meth:`PagedKVPool.begin_step` (rows of different lengths) and passes the step's
      ``input_ids``/``attention_mask`` to the model;
    * as any other cache, ``model.generate(ids, cache=pool.model_cache())``: the first
      layer starts an implicit step whose rows are the batch rows.

    Args:
        pool: the pool this layer reads and writes.
        layer: the layer index.
    """

    def __init__(self, *, pool: PagedKVPool, layer: int) -> None:
        super().__init__()
        self.pool = pool
        self.layer = layer

    def key_slots(self, start: Start, num_new: int, device: torch.device | None = None) -> Tensor:
        return torch.arange(int(start) + num_new, device=device)[None]  # [1, T]

    def _step(self, batch: int, start: int, num_new: int) -> StepBatch:
        step = self.pool.step
        if self.layer == 0 and (step is None or self.pool._implicit):
            step = self.pool.implicit_step(batch, start, num_new)
        if step is None:
            raise ValueError("the paged cache's first layer must run before the others")
        if step.input_ids.shape[0] != batch or step.input_ids.shape[1] != num_new:
            raise ValueError(
                f"the step was laid out for {tuple(step.input_ids.shape)} (rows, new tokens), "
                f"got keys for {(batch, num_new)}"
            )
        if start != step.start:
            raise ValueError(f"the step starts at slot {step.start}, got start={start}")
        return step

    @property
    def block_size(self) -> int:
        """Tokens per block of the pool (a paged call's ``AttentionCall.block_size``); 0
        for a quantized pool, which is read by gathering (and dequantizing) only."""
        return 0 if self.pool.storage.quantized else self.pool.block_size

    def update(self, key: Tensor, value: Tensor, *, start: Start) -> tuple[Tensor, Tensor]:
        step = self._write(key, value, start)
        b, h, _, d = key.shape
        t = step.total
        kg, vg = self.pool.storage.read(self.layer, step.gather)  # [B*T, H_kv, h_d]
        keys = kg.view(b, t, h, d).transpose(1, 2)  # [B, H_kv, T, h_d]
        values = vg.view(b, t, h, -1).transpose(1, 2)
        return keys, values

    def view(self, key: Tensor, value: Tensor, plan: AttentionPlan) -> KVView:
        """Write the new keys/values into the pool; return the pools and block tables when
        the plan's backend reads blocks, else every row's keys gathered (with the plan's
        key slots)."""
        if plan.write_slots is not None:
            return self._flat_view(key, value, plan)
        if plan.reads_blocks:
            kp, vp, table = self.update_blocks(key, value, start=plan.start)
            return KVView(kp, vp, None, table)
        k, v = self.update(key, value, start=plan.start)
        return KVView(k, v, plan.k_positions)

    def _flat_view(self, key: Tensor, value: Tensor, plan: AttentionPlan) -> KVView:
        """A flat serving step: the row's keys/values ``[1, H_kv, N, h_d]`` go to their
        pool slots; the attention reads the pools through the block tables, or every
        sequence's keys gathered ``[n_s, H_kv, T, h_d]`` with their positions."""
        assert plan.write_slots is not None and plan.blocks is not None
        storage = self.pool.storage
        storage.write(
            self.layer, plan.write_slots, key[0].transpose(0, 1), value[0].transpose(0, 1)
        )  # [N, H_kv, h_d]
        kp, vp = storage.keys[self.layer], storage.values[self.layer]
        if plan.reads_blocks:
            if storage.quantized:
                raise ValueError(
                    f"the paged pool holds {storage.kv_dtype} levels, read by gathering only; "
                    f"the plan's backend {plan.backend.name!r} reads the pools directly"
                )
            return KVView(kp, vp, None, plan.blocks)
        idx, pos = plan.blocks.gather_index()  # [n_s * T], [n_s, T]
        n, t = pos.shape
        h = kp.shape[1]
        if storage.quantized:
            kg, vg = storage.read(self.layer, idx)  # [n_s*T, H_kv, h_d]
            keys = kg.view(n, t, h, -1).transpose(1, 2)
            return KVView(keys, vg.view(n, t, h, -1).transpose(1, 2), pos)
        # rows of a 2-d view: one contiguous copy per slot (3x faster than a 3-d select)
        keys = kp.view(kp.shape[0], -1).index_select(0, idx).view(n, t, h, -1).transpose(1, 2)
        values = vp.view(vp.shape[0], -1).index_select(0, idx).view(n, t, h, -1).transpose(1, 2)
        return KVView(keys, values, pos)  # [n_s, H_kv, T, h_d], slots [n_s, T]

    def update_blocks(
        self, key: Tensor, value: Tensor, *, start: Start
    ) -> tuple[Tensor, Tensor, BlockTable]:
        """Store the new keys/values like :meth:`update`, but return the layer's pools
        (``[N * bs, H_kv, h_d]``) and the step's block tables instead of gathering: the
        input of a backend that reads blocks (:mod:`attnlab.backends.paged`)."""
        step = self._write(key, value, start)
        assert step.blocks is not None  # every step the pool lays out has its tables
        return self.pool.keys[self.layer], self.pool.values[self.layer], step.blocks

    def _write(self, key: Tensor, value: Tensor, start: Start) -> StepBatch:
        start = int(start)  # the pool lays out its steps by int slots (host side)
        if key.dim() != 4 or value.dim() != 4 or key.shape[:3] != value.shape[:3]:
            raise ValueError(
                "key and value must be [batch, kv_heads, new_tokens, head_dim] with equal "
                f"leading dims, got {tuple(key.shape)} and {tuple(value.shape)}"
            )
        b, h, n, d = key.shape
        step = self._step(b, start, n)
        k_new = key.transpose(1, 2).reshape(b * n, h, d)  # [B*L, H_kv, h_d]
        v_new = value.transpose(1, 2).reshape(b * n, h, value.shape[-1])
        if not step.all_new:
            k_new, v_new = k_new.index_select(0, step.src), v_new.index_select(0, step.src)
        self.pool.storage.write(self.layer, step.dst, k_new, v_new)
        if self.pool._implicit:
            self.length = start + n
        return step

    def fork(self, parent: SeqId, child: SeqId) -> None:
        """Fork a sequence in every layer of the pool (block tables are shared by the layers)."""
        self.pool.fork(parent, child)

    def select(self, rows: Tensor) -> None:
        """Keep/reorder the batch rows of a plain model call (forks rows taken twice).

        The layers share the block tables: the first layer's call does it for all.
        """
        if self.layer == 0:
            self.pool.select_rows(rows)

    def reset(self) -> None:
        """Free every sequence of the pool (all layers: they share the block tables)."""
        self.pool.reset()

    def nbytes(self) -> int:
        """Bytes of this layer's keys/values (and their scales) in the blocks held now."""
        st = self.pool.storage
        per_slot = sum(
            t[0].numel() * t.element_size()
            for t in (st.keys[self.layer], st.values[self.layer])
            + ((st.key_stats[self.layer], st.value_stats[self.layer]) if st.quantized else ())
        )
        return self.pool.num_used_blocks * self.pool.block_size * per_slot
