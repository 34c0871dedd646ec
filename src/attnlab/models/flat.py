"""A flat token batch: one serving step's tokens of many sequences in one ``[1, N]`` row.

Shape notation: ``N`` tokens of the step, ``n_s`` sequences, ``D`` width.

The serving runner lays a step out as one row, every sequence's new tokens (one for a
decoding sequence, a chunk of its prompt for a prefilling one) one after the other, with
each token's position in its own sequence: no padding is computed by the projections,
the feed-forwards or the output head. Attention layers see it through the plan's
:class:`~attnlab.backends.plan.SequenceLayout` (the ``document`` pattern of the row over
the paged KV); recurrent layers run each :class:`~attnlab.backends.plan.StateGroup` of
sequences as rows of a batch over their state slots (:func:`run_grouped`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

from attnlab.backends.call import AttentionCall
from attnlab.backends.plan import AttentionPlan, BlockTable, SequenceLayout, make_plan
from attnlab.cache.base import ModelCache
from attnlab.cache.recurrent import RecurrentState
from attnlab.cache.state_slots import StateSlots
from attnlab.models.decoder_parts import layer_pattern

if TYPE_CHECKING:
    from attnlab.models.decoder import DecoderLM

__all__ = ["FlatBatch", "decoder_forward_flat", "flat_plans", "run_grouped"]


@dataclass(frozen=True)
class FlatBatch:
    """What a model's ``forward_flat`` needs beside the token ids ``[1, N]``.

    Attributes:
        positions: long ``[1, N]`` each token's position in its own sequence.
        layout: the sequences' boundaries and groups.
        last: long ``[n_s]`` flat index of each sequence's last token (its logits).
        blocks: the sequences' block tables (attention layers), or None.
        write_slots: long ``[N]`` pool slot of each token's key/value, or None.
        state_slots: long ``[n_s]`` each sequence's state slot (recurrent layers), or None.
    """

    positions: Tensor
    layout: SequenceLayout
    last: Tensor
    blocks: BlockTable | None = None
    write_slots: Tensor | None = None
    state_slots: Tensor | None = None


#: ``fn(x [n_g, L, D], positions [n_g, L], state) -> [n_g, L, D]``, updating ``state``.
StatefulFn = Callable[[Tensor, Tensor, RecurrentState], Tensor]


def run_grouped(
    fn: StatefulFn,
    x: Tensor,
    layout: SequenceLayout,
    positions: Tensor,
    state_slots: Tensor,
    cache: StateSlots,
) -> Tensor:
    """Run a recurrent layer over a flat row ``x [1, N, D]``, group by group.

    Each group's sequences have as many new tokens each and start (or continue) their
    states together, so they run as ``[n_g, L, D]`` with no padding: their states are
    gathered from ``cache``'s slots, advanced by ``fn`` and written back.

    Returns:
        ``[1, N, D]``: every token's output, in the row's order.
    """
    out = x.new_empty(x.shape)
    flat = x[0]  # [N, D]
    for g in layout.state_groups:
        xg = flat.index_select(0, g.tokens).view(-1, g.length, flat.shape[-1])  # [n_g, L, D]
        pg = positions[0].index_select(0, g.tokens).view(-1, g.length)  # [n_g, L]
        slots = state_slots.index_select(0, g.rows)
        state = cache.gather(slots, g.fresh)
        y = fn(xg, pg, state)
        cache.scatter(slots, state)
        out[0].index_copy_(0, g.tokens, y.reshape(-1, y.shape[-1]))
    return out


def flat_plans(
    model: DecoderLM, x: Tensor, batch: FlatBatch, cache: ModelCache
) -> dict[int | None, AttentionPlan]:
    """One plan per sliding window of the layers: the per-sequence pattern (causal, the
    window, the score modifiers; no padding: there is none) on each token's position."""
    c = model.decoder_config
    assert c.head_dim is not None and c.num_key_value_heads is not None
    lengths = batch.layout.lengths
    n_s, width = len(lengths), max(lengths)
    total = max(batch.blocks.lengths) if batch.blocks is not None else width
    # a pool holding int8/int4 levels is read by gathering only (its layers say block 0)
    quantized = any(getattr(c, "block_size", None) == 0 for c in cache.layers)
    block_size = batch.blocks.block_size if batch.blocks is not None and not quantized else 0
    plans: dict[int | None, AttentionPlan] = {}
    for window in dict.fromkeys(model.layer_windows):
        pattern = layer_pattern(window, None, None, model._score_mods)
        call = AttentionCall(
            query_shape=(n_s, c.num_attention_heads, width, c.head_dim),
            key_shape=(n_s, c.num_key_value_heads, total, c.head_dim),
            value_shape=(n_s, c.num_key_value_heads, total, c.head_dim),
            dtype=x.dtype,
            device=x.device,
            mask="pattern",
            pattern=pattern,
            is_causal=False,
            dropout_p=0.0,
            enable_gqa=c.num_key_value_heads != c.num_attention_heads,
            needs_grad=False,
            return_weights=False,
            positions=True,
            block_size=block_size,
        )
        plans[window] = make_plan(
            call,
            backend=model.backend,
            pattern=pattern,
            positions=batch.positions,
            q_positions=batch.positions,
            layout=batch.layout,
            blocks=batch.blocks,
            write_slots=batch.write_slots,
            state_slots=batch.state_slots,
        )
    return plans


def decoder_forward_flat(
    model: DecoderLM,
    input_ids: Tensor,
    batch: FlatBatch,
    cache: ModelCache,
    plans: dict[int | None, AttentionPlan] | None = None,
) -> Tensor:
    """:meth:`DecoderLM.forward_flat`: the decoder's layers over one flat row
    ``input_ids [1, N]``, each with its window's plan and its serving cache (the paged
    pool's layer, or its state slots); logits ``[n_s, V]`` of each sequence's last token.

    ``plans``: one per window, made beforehand (a compiled decode bucket's, whose backend
    was chosen before tracing); default: made here for ``batch``.
    """
    x = model._embed_extras(model.embed_tokens(input_ids), batch.positions)  # [1, N, D]
    if plans is None:
        plans = flat_plans(model, x, batch, cache)
    for layer, layer_cache, window in zip(model.layers, cache.layers, model.layer_windows):
        x = layer(x, plans[window], layer_cache)[0]
    x = model.norm(x.index_select(1, batch.last))  # [1, n_s, D]
    return model._head(x)[0]  # [n_s, V]
