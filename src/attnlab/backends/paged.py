"""The ``paged`` backend: attention that reads keys/values through a block table.

A paged KV cache keeps every sequence's keys/values in fixed-size blocks of one pool
per layer, in whatever order the allocator handed the blocks out; a *block table*
lists a sequence's blocks in order (PagedAttention, Kwon et al., 2023, "Efficient
memory management for large language model serving with PagedAttention", section 4.1).
The cache's reference path gathers every row's keys through its table slot by slot
into a left-padded ``[B, H_kv, T, h_d]`` batch (``T`` the longest row) and lets any
backend attend over it with the step's padding pattern. This backend takes the pool
and the tables instead and copies whole blocks (``bs`` tokens, one contiguous run
each), only from the first block any row still holds (blocks freed behind a sliding
window are not read) to the last one any row fills; when every row sees every key it
read (a decode step of equal-length rows) no mask is built and torch's fused kernel
runs unmasked. One kernel call for the whole batch. What it cannot avoid, written in
PyTorch on a CPU, is the copy itself: no PyTorch kernel multiplies through an index
table in place (the cost model, :data:`attnlab.backend_traits.PAGED_COST`, says when
the difference pays).

Exact: it computes the same softmax over the same keys as the gather path (up to
floating-point rounding), with the pattern and its score modifiers evaluated on the
keys' slots in the step's layout.

Shape notation: ``B`` rows, ``H`` query heads, ``H_kv`` key/value heads, ``L`` query
positions of the step, ``T`` virtual slots of the step, ``S'`` keys read per row,
``N`` blocks in the pool, ``bs`` block size, ``E``/``Ev`` key/value head dims.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.backend_traits import PAGED_COST, TRAITS
from attnlab.backends.call import AttentionCall, Backend
from attnlab.backends.cost_model import Estimate, estimate, format_seconds, gather_seconds
from attnlab.backends.plan import BlockTable
from attnlab.backends.registry import register
from attnlab.backends.sdpa import sdpa_torch
from attnlab.functional.attention import repeat_kv
from attnlab.functional.masks import MaskPattern
from attnlab.functional.score_mods import apply_score_mods

__all__ = ["BlockTable", "paged_attention"]


def _attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor | None,
    mods: tuple,
    rows: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    scale: float | None,
    enable_gqa: bool,
) -> Tensor:
    """``q [B, H, L, E]`` over ``k [B, H_kv, S', E]`` with a bool mask (or None)."""
    if not mods:
        out, _ = sdpa_torch(q, k, v, allowed, 0.0, False, scale, enable_gqa, check_finite=False)
        return out
    # score modifiers (ALiBi, soft-capping): the reference's math on the keys read
    rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, rep), repeat_kv(v, rep)  # [B, H, S', E]
    s = 1.0 / q.shape[-1] ** 0.5 if scale is None else scale
    dt = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scores = (q.to(dt) @ k.to(dt).transpose(-1, -2)) * s  # [B, H, L, S']
    h = torch.arange(q.shape[1], device=q.device).view(-1, 1, 1)
    qi = q_pos.view(-1, 1, q_pos.shape[-1], 1)  # [B|1, 1, L, 1]
    ki = k_pos.view(-1, 1, 1, k_pos.shape[-1])  # [B, 1, 1, S']
    scores, _ = apply_score_mods(mods, scores, rows.view(-1, 1, 1, 1), h, qi, ki)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    w = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no key: zeros
    return (w @ v.to(dt)).to(q.dtype)


def paged_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: MaskPattern | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    return_weights: bool = False,
    q_positions: Tensor | None = None,
    k_positions: Tensor | None = None,
    block_table: BlockTable | None = None,
) -> tuple[Tensor, None]:
    """Attend from ``query [B, H, L, E]`` to the keys ``block_table`` points at in the pool.

    Args:
        query: ``[B, H, L, E]``.
        key: the layer's key pool ``[N * bs, H_kv, E]``.
        value: the layer's value pool ``[N * bs, H_kv, Ev]``.
        attn_mask: the pattern (with its score modifiers), evaluated on the keys' slots
            (``BlockTable.offsets[b] + p``) and ``q_positions``; None attends every
            stored key.
        dropout_p: must be 0 (checked by the registry).
        is_causal: folded into the pattern (``causal()`` on slots).
        scale: score scale (default ``1/sqrt(E)``).
        enable_gqa: ``H`` a multiple of ``H_kv``.
        return_weights: must be False (checked by the registry).
        q_positions: long ``[B|1, L]`` slots of the queries (default ``T - L .. T - 1``).
        k_positions: ignored: the keys' slots come from the block table.
        block_table: the rows' block tables (required).

    Returns:
        ``(output [B, H, L, Ev], None)``.

    Raises:
        ValueError: no ``block_table``, or pools that are not ``[slots, H_kv, E]``.
    """
    del dropout_p, return_weights, k_positions
    if block_table is None:
        raise ValueError("the paged backend reads keys through a block table: pass block_table=")
    if key.dim() != 3 or value.dim() != 3:
        raise ValueError(
            "the paged backend takes the layer's pools [slots, kv_heads, head_dim], got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    from attnlab.functional.masks import causal

    pattern = attn_mask
    if is_causal:
        pattern = causal() if pattern is None else pattern & causal()
    mods = pattern.score_mods if pattern is not None else ()
    bare = pattern._unscored() if pattern is not None else None
    b, _, L, _ = query.shape
    bs = block_table.block_size
    h_kv, e, ev = key.shape[1], key.shape[-1], value.shape[-1]
    dev = query.device
    lengths, offsets, first = block_table.lengths, block_table.offsets, block_table.first_block
    total = offsets[0] + lengths[0]  # T, the same for every row
    if q_positions is None:
        q_positions = torch.arange(total - L, total, device=dev)[None]
    fb = min(first)  # the first block any row still holds
    nb = max(-(-n // bs) for n in lengths)  # the last block any row holds
    if nb <= fb:
        return query.new_zeros(b, query.shape[1], L, ev), None
    ids = block_table.table[:, fb:nb].reshape(-1)  # [B * nb']
    s_len = (nb - fb) * bs
    # whole blocks, one contiguous copy each: [B, nb' * bs, H_kv, E]
    k = key.view(-1, bs, h_kv, e).index_select(0, ids).view(b, s_len, h_kv, e).transpose(1, 2)
    v = value.view(-1, bs, h_kv, ev).index_select(0, ids).view(b, s_len, h_kv, ev).transpose(1, 2)
    # slot of each key in the step's layout; -1 past a row's tokens or in its freed blocks
    j = torch.arange(fb * bs, nb * bs, device=dev)[None]  # [1, S'] token index in the row
    t = torch.tensor([list(x) for x in zip(lengths, offsets, first)], device=dev)  # [B, 3]
    live = (j < t[:, :1]) & (j >= t[:, 2:] * bs)
    k_pos = torch.where(live, j + t[:, 1:2], -1)  # [B, S']
    rows = torch.arange(b, device=dev)
    zero = torch.zeros((), dtype=torch.long, device=dev)
    allowed: Tensor | None = live.view(b, 1, 1, s_len)
    if bare is not None:
        row_ids = rows.view(-1, 1, 1, 1) if bare.batch_dependent else zero
        qi = q_positions.view(-1, 1, L, 1)  # [B|1, 1, L, 1]
        ki = k_pos.view(b, 1, 1, s_len)
        allowed = bare.mask_mod(row_ids, zero, qi, ki) & live.view(b, 1, 1, s_len)
    assert allowed is not None
    if bool(allowed.all()):
        allowed = None  # every row sees every key read (a uniform decode step): no mask
    out = _attention(query, k, v, allowed, mods, rows, q_positions, k_pos, scale, enable_gqa)
    return out, None


def _check(call: AttentionCall) -> str | None:
    if call.block_size <= 0:
        return "reads keys through a paged cache's block table; the keys here are contiguous"
    if call.dropout_p > 0:
        return "no dropout (an inference path)"
    if call.return_weights:
        return "returns no attention weights"
    if call.mask in ("bool", "float"):
        return "takes a mask pattern, not a dense mask"
    return None


def _cost(call: AttentionCall) -> Estimate | None:
    if call.device.type != "cpu":
        return None
    L, S = call.query_shape[-2], call.key_shape[-2]
    attend = estimate("sdpa_flash", call, L * S)
    if attend is None:
        return None
    # the same bytes copied as the gather path (whole blocks instead of slots), then
    # torch's kernel, unmasked when every row sees every key it read (a decode step)
    seconds = PAGED_COST.call_overhead_s + gather_seconds(call) + attend.seconds
    note = f"~{format_seconds(seconds)}: copies each row's blocks through its table, one call"
    return Estimate(seconds, note)


PAGED = register(
    Backend(fn=paged_attention, check=_check, cost=_cost, **TRAITS["paged"].registry_fields())
)
