"""The ``paged`` backend: attention that reads keys/values through a block table.

A paged KV cache keeps every sequence's keys/values in fixed-size blocks of one pool
per layer, in whatever order the allocator handed the blocks out; a *block table*
lists a sequence's blocks in order (PagedAttention, Kwon et al., 2023, "Efficient
memory management for large language model serving with PagedAttention", section 4.1).
The cache's reference path gathers every row's keys through its table into a
left-padded ``[B, H_kv, T, h_d]`` batch (``T`` the longest row) and lets any backend
attend over it with a padding pattern. This backend instead takes the pool and the
table and reads, for each group of rows of equal length, only the blocks those rows
hold: no padding slots, no blocks freed behind a sliding window, and no dense mask
when the pattern lets the rows see every stored key (a decode step), so torch's fused
kernel runs unmasked. Rows of different lengths are separate kernel calls: the price
is one call per group, which the cost model weighs (:data:`attnlab.backend_traits.PAGED_COST`).

Exact: it computes the same softmax over the same keys as the gather path (up to
floating-point rounding), with the pattern and its score modifiers evaluated on the
keys' slots in the step's layout.

Shape notation: ``B`` rows, ``H`` query heads, ``H_kv`` key/value heads, ``L`` query
positions of the step, ``T`` virtual slots of the step, ``n`` a row's stored tokens,
``N`` blocks in the pool, ``bs`` block size, ``E``/``Ev`` key/value head dims.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnlab.backend_traits import PAGED_COST, TRAITS
from attnlab.backends.cost_model import Estimate, estimate, format_seconds, gather_seconds
from attnlab.backends.registry import AttentionCall, Backend, register
from attnlab.backends.sdpa import sdpa_torch
from attnlab.functional.attention import repeat_kv
from attnlab.functional.masks import MaskPattern
from attnlab.functional.score_mods import apply_score_mods

__all__ = ["BlockTable", "paged_attention"]


@dataclass(frozen=True)
class BlockTable:
    """Where each row's keys/values live in a paged pool, in a step's layout.

    Row ``b`` holds ``lengths[b]`` tokens; token ``p`` sits in pool slot
    ``table[b, p // bs] * bs + p % bs`` and at slot ``offsets[b] + p`` of the step's
    virtual layout (the slot the pattern sees: ``offsets[b] = T - lengths[b]``, the
    row's left padding). Blocks before ``first_block[b]`` were freed (wholly outside
    a sliding window) and are not read.

    Attributes:
        table: long ``[B, nb]`` block ids (entries past a row's blocks are ignored).
        block_size: tokens per block ``bs``.
        lengths: tokens stored per row (host ints).
        offsets: virtual slot of each row's token 0 (host ints).
        first_block: first block each row still holds (host ints).
    """

    table: Tensor
    block_size: int
    lengths: tuple[int, ...]
    offsets: tuple[int, ...]
    first_block: tuple[int, ...]

    def groups(self) -> list[list[int]]:
        """Rows that can share one kernel call: equal ``(lengths, offsets, first_block)``."""
        by_key: dict[tuple[int, int, int], list[int]] = {}
        for r, key in enumerate(zip(self.lengths, self.offsets, self.first_block)):
            by_key.setdefault(key, []).append(r)
        return list(by_key.values())


def _row_attention(
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
    """One group's attention: ``q [G, H, L, E]`` over ``k [G, H_kv, n, E]``."""
    if not mods:
        out, _ = sdpa_torch(q, k, v, allowed, 0.0, False, scale, enable_gqa, check_finite=False)
        return out
    # score modifiers (ALiBi, soft-capping): the reference's math on this group's keys
    rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, rep), repeat_kv(v, rep)  # [G, H, n, E]
    s = 1.0 / q.shape[-1] ** 0.5 if scale is None else scale
    dt = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scores = (q.to(dt) @ k.to(dt).transpose(-1, -2)) * s  # [G, H, L, n]
    h = torch.arange(q.shape[1], device=q.device).view(-1, 1, 1)
    qi = q_pos.view(-1, 1, q_pos.shape[-1], 1)  # [G|1, 1, L, 1]
    ki = k_pos.view(-1, 1, 1, k_pos.shape[-1])  # [G|1, 1, 1, n]
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
    b, h, L, _ = query.shape
    bs = block_table.block_size
    h_kv = key.shape[1]
    k_blocks = key.view(-1, bs, h_kv, key.shape[-1])  # [N, bs, H_kv, E]
    v_blocks = value.view(-1, bs, h_kv, value.shape[-1])  # [N, bs, H_kv, Ev]
    dev = query.device
    total = block_table.offsets[0] + block_table.lengths[0]  # T, the same for every row
    if q_positions is None:
        q_positions = torch.arange(total - L, total, device=dev)[None]
    out = query.new_zeros(b, h, L, value.shape[-1])
    zero = torch.zeros((), dtype=torch.long, device=dev)
    for rows in block_table.groups():
        r0 = rows[0]
        n, off, fb = block_table.lengths[r0], block_table.offsets[r0], block_table.first_block[r0]
        if n == 0:
            continue
        skip = fb * bs  # tokens of the freed leading blocks
        nb = -(-n // bs)
        idx = torch.tensor(rows, device=dev)
        ids = block_table.table.index_select(0, idx)[:, fb:nb]  # [G, nb']
        g = len(rows)
        k = k_blocks[ids].view(g, -1, h_kv, key.shape[-1])[:, : n - skip]  # [G, n', H_kv, E]
        v = v_blocks[ids].view(g, -1, h_kv, value.shape[-1])[:, : n - skip]
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [G, H_kv, n', E]
        k_pos = torch.arange(off + skip, off + n, device=dev)[None]  # [1, n']
        q_pos = q_positions if q_positions.shape[0] == 1 else q_positions.index_select(0, idx)
        allowed: Tensor | None = None
        if bare is not None:
            row_ids = idx.view(-1, 1, 1, 1) if bare.batch_dependent else zero
            qi = q_pos.view(-1, 1, L, 1)  # [G|1, 1, L, 1]
            ki = k_pos.view(1, 1, 1, -1)  # [1, 1, 1, n']
            allowed = bare.mask_mod(row_ids, zero, qi, ki).expand(g, 1, L, k_pos.shape[-1])
            if bool(allowed.all()):
                allowed = None  # every stored key is seen (a decode step): unmasked kernel
        q = query.index_select(0, idx) if g < b else query
        res = _row_attention(q, k, v, allowed, mods, idx, q_pos, k_pos, scale, enable_gqa)
        if g == b:
            out = res
        else:
            out.index_copy_(0, idx, res)
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
    # one group per row in the worst case (mixed lengths); a uniform batch is one group
    groups = call.query_shape[0]
    seconds = PAGED_COST.group_overhead_s * groups + gather_seconds(call) + attend.seconds
    note = (
        f"~{format_seconds(seconds)}: reads each row's own blocks (no padding, no dense mask), "
        f"up to {groups} kernel call(s)"
    )
    return Estimate(seconds, note)


PAGED = register(
    Backend(fn=paged_attention, check=_check, cost=_cost, **TRAITS["paged"].registry_fields())
)
