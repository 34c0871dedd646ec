"""Running one attention call on its backend, in the form of mask and positions it takes.

The choice was made before (:mod:`attnlab.backends.select`, once per model forward for a
plan); this module adapts the call to the backend (a pattern evaluated into a dense mask
for a backend without patterns, positions folded into the mask for one without
positions, a paged cache's pools and block tables for a backend that reads blocks) and
calls it. :func:`attend` runs an :class:`~attnlab.backends.plan.AttentionPlan` over a
cache's :class:`~attnlab.backends.plan.KVView`: the one path of every model layer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.backends.call import AttentionCall, Backend
from attnlab.backends.plan import AttentionPlan, BlockTable, KVView, SequenceLayout
from attnlab.backends.registry import get
from attnlab.backends.select import _memoized
from attnlab.functional.attention import AttnMask, pattern_mask, resolve_mask
from attnlab.functional.masks import MaskPattern

__all__ = ["attend", "dispatch", "dispatch_trusted"]


def _positions_mask(
    is_causal: bool,
    attn_mask: AttnMask,
    target: tuple[int, ...],
    device: torch.device,
    q_positions: Tensor | None,
    k_positions: Tensor | None,
) -> Tensor | None:
    """For a backend without positions: pattern, ``is_causal`` and empty keys as one dense mask."""
    from attnlab.functional.masks import causal, combine, full

    pattern = attn_mask._unscored() if isinstance(attn_mask, MaskPattern) else None
    dense = None if isinstance(attn_mask, MaskPattern) else attn_mask
    if is_causal:
        pattern = causal() if pattern is None else pattern & causal()
    if pattern is None and k_positions is not None:
        pattern = full()  # the empty keys (-1) still have to be masked
    by_pos = None
    if pattern is not None:
        by_pos = pattern_mask(
            pattern, target, device=device, q_positions=q_positions, k_positions=k_positions
        )
    return combine(resolve_mask(dense, target, device=device), by_pos)


def _run(
    b: Backend,
    is_causal: bool,
    dropout_p: float,
    enable_gqa: bool,
    return_weights: bool,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: AttnMask,
    scale: float | None,
    q_positions: Tensor | None,
    k_positions: Tensor | None,
    trusted: bool = False,
    block_table: object | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Hand one call to backend ``b``, in the form of mask and positions it takes
    (``trusted``: the library's own call, without the backend's data checks)."""
    target = (*query.shape[:-1], key.shape[-2])  # [B.., H, L, S]
    extra: dict[str, object] = {}
    positions = q_positions is not None or k_positions is not None
    if positions and b.accepts_positions:
        extra = {"q_positions": q_positions, "k_positions": k_positions}
    if b.reads_blocks:
        extra["block_table"] = block_table
    mask = attn_mask
    if positions and not b.accepts_positions:
        mask = _positions_mask(is_causal, attn_mask, target, query.device, q_positions, k_positions)
        is_causal = False
    elif not (isinstance(attn_mask, MaskPattern) and b.accepts_patterns):
        mask = resolve_mask(
            attn_mask, target, device=query.device, q_positions=q_positions, k_positions=k_positions
        )
    fn = b.trusted_fn if trusted and b.trusted_fn is not None else b.fn
    return fn(
        query,
        key,
        value,
        mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        return_weights=return_weights,
        **extra,
    )


def dispatch(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: AttnMask,
    *,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    backend: str,
    return_weights: bool,
    q_positions: Tensor | None = None,
    k_positions: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Run one (already validated) attention call on the backend memoized for its signature."""
    b, _ = _memoized(
        query,
        key,
        value,
        attn_mask,
        backend=backend,
        dropout_p=dropout_p,
        is_causal=is_causal,
        enable_gqa=enable_gqa,
        return_weights=return_weights,
        positions=q_positions is not None or k_positions is not None,
    )
    return _run(
        b,
        is_causal,
        dropout_p,
        enable_gqa,
        return_weights,
        query,
        key,
        value,
        attn_mask,
        scale,
        q_positions,
        k_positions,
    )


def dispatch_trusted(
    call: AttentionCall,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    *,
    scale: float | None = None,
    backend: str = "auto",
    q_positions: Tensor | None = None,
    k_positions: Tensor | None = None,
    block_table: object | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Run a call described once by ``call`` (the library's internal path: no re-validation).

    A model builds one :class:`AttentionCall` per forward (shapes, dtype, mask kind,
    pattern, grad mode) and every layer runs through it; the inputs were validated at
    the entry the user called (``docs/contracts.md``, section 1).

    Args:
        call: the call's description; its ``pattern`` is the mask when ``attn_mask`` is None.
        query: ``[B.., H, L, E]``.
        key: ``[B.., H_kv, S, E]``.
        value: ``[B.., H_kv, S, Ev]``.
        attn_mask: a dense mask (when ``call.mask`` is ``"bool"`` or ``"float"``).
        scale: score scale (default ``1/sqrt(E)``).
        backend: ``"auto"`` or a backend name.
        q_positions: long ``[B or 1, L]`` query positions, or None.
        k_positions: long ``[B or 1, S]`` key positions (``-1`` empty), or None.
        block_table: for a backend that reads blocks (``call.block_size > 0``), the
            rows' block tables; ``key``/``value`` are then the layer's pools.

    Returns:
        ``(output [B.., H, L, Ev], weights or None)``.
    """
    mask: AttnMask = call.pattern if attn_mask is None else attn_mask
    if backend != "auto":  # a name (a model resolves its backend once per forward)
        b = get(backend)
    else:
        b, _ = _memoized(
            query,
            key,
            value,
            mask,
            backend=backend,
            dropout_p=call.dropout_p,
            is_causal=call.is_causal,
            enable_gqa=call.enable_gqa,
            return_weights=call.return_weights,
            positions=call.positions,
            call=call,
        )
    return _run(
        b,
        call.is_causal,
        call.dropout_p,
        call.enable_gqa,
        call.return_weights,
        query,
        key,
        value,
        mask,
        scale,
        q_positions,
        k_positions,
        trusted=True,
        block_table=block_table,
    )


def attend(
    plan: AttentionPlan, query: Tensor, kv: KVView, *, scale: float | None = None
) -> tuple[Tensor, Tensor | None]:
    """Run ``plan``'s attention from ``query`` over the keys/values ``kv`` (trusted path).

    Args:
        plan: the forward's plan (backend chosen, pattern, slots, layout).
        query: ``[B, H, L, E]`` (``[1, H, N, E]`` for a flat batch).
        kv: what the layer's cache returned for the plan (or the new keys/values,
            without a cache).
        scale: score scale (default ``1/sqrt(E)``).

    Returns:
        ``(output [B, H, L, Ev], weights or None)``.
    """
    if plan.layout is not None:
        return _attend_flat(plan, plan.layout, query, kv, scale), None
    call = plan.call
    k_pos = None if kv.block_table is not None else kv.k_positions
    if kv.block_table is None and k_pos is None:
        k_pos = plan.k_positions
    return _run(
        plan.backend,
        call.is_causal,
        call.dropout_p,
        call.enable_gqa,
        call.return_weights,
        query,
        kv.key,
        kv.value,
        plan.pattern,
        scale,
        plan.q_positions,
        k_pos,
        trusted=True,
        block_table=kv.block_table,
    )


def _attend_flat(
    plan: AttentionPlan,
    layout: SequenceLayout,
    query: Tensor,
    kv: KVView,
    scale: float | None,
) -> Tensor:
    """A flat row's attention, one call per group of sequences (rows of a batch).

    ``query [1, H, N, E]``; ``kv`` holds either the pools and every sequence's block
    table, or every sequence's keys gathered ``[n_s, H_kv, T, E]`` with their slots
    ``[n_s, T]``. The output ``[1, H, N, Ev]`` holds every token's attention within its
    own sequence (the ``document`` pattern of the row).
    """
    call = plan.call
    h, e = query.shape[1], query.shape[-1]
    q_flat = query[0]  # [H, N, E]
    assert plan.q_positions is not None
    q_pos = plan.q_positions[0]  # [N]
    out: Tensor | None = None
    for i, g in enumerate(layout.groups):
        n_g = g.spread.shape[0] // g.width  # len(g.rows), or symbolic in a compiled step
        backend = plan.group_backend(i)
        q = q_flat.index_select(1, g.spread).view(h, n_g, g.width, e).transpose(0, 1)
        qp = q_pos.index_select(0, g.spread).view(n_g, g.width)  # [n_g, W_g]
        if kv.block_table is not None and backend.reads_blocks:
            key, value, kp, table = kv.key, kv.value, None, g.blocks
        elif kv.block_table is not None:  # this group's keys gathered from the pools
            assert g.blocks is not None
            key, value, kp = _gather_group(kv.key, kv.value, g.blocks)
            table = None
        elif g.rows == tuple(range(kv.key.shape[0])):  # every sequence (a decode step)
            key, value, kp, table = kv.key, kv.value, kv.k_positions, None
        else:
            rows = torch.tensor(g.rows, dtype=torch.long, device=query.device)
            key, value = kv.key.index_select(0, rows), kv.value.index_select(0, rows)
            assert kv.k_positions is not None
            kp, table = kv.k_positions.index_select(0, rows), None
        o, _ = _run(
            backend,
            False,
            call.dropout_p,
            call.enable_gqa,
            False,
            q,
            key,
            value,
            plan.pattern,
            scale,
            qp,
            kp,
            trusted=True,
            block_table=table,
        )  # [n_g, H, W_g, Ev]
        o = o.transpose(0, 1).reshape(h, n_g * g.width, -1)  # [H, n_g * W_g, Ev]
        if out is None:
            out = o.new_empty(h, query.shape[2], o.shape[-1])
        out.index_copy_(1, g.keep, o.index_select(1, g.places))
    assert out is not None
    return out.unsqueeze(0)  # [1, H, N, Ev]


def _gather_group(key_pool: Tensor, value_pool: Tensor, blocks: BlockTable) -> tuple:
    """A group's keys/values copied out of float pools ``[slots, H_kv, E]`` through its
    block tables: ``([n_g, H_kv, T_g, E], [n_g, H_kv, T_g, Ev], slots [n_g, T_g])``, the
    slot ``-1`` past a row's tokens (one contiguous row copy per token, as the cache's
    gather path does); the index is made once per step, shared by the layers."""
    idx, pos = blocks.gather_index()
    n, t = pos.shape
    h = key_pool.shape[1]
    keys = key_pool.view(key_pool.shape[0], -1).index_select(0, idx).view(n, t, h, -1)
    values = value_pool.view(value_pool.shape[0], -1).index_select(0, idx).view(n, t, h, -1)
    return keys.transpose(1, 2), values.transpose(1, 2), pos
