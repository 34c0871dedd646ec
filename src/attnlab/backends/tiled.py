"""The ``tiled`` backend: the FlashAttention algorithm, written in PyTorch.

Queries are processed in blocks of ``block_q`` rows; each block meets the keys in
blocks of ``block_k`` with an online softmax (a running row maximum ``m``, a
running normaliser ``l`` and an unnormalised output, rescaled when the maximum
grows), so the ``L x S`` score matrix never exists. The forward keeps only the
output and the row log-sum-exp ``lse = m + log l``; the backward recomputes each
tile's probabilities from ``lse`` instead of storing them (Dao et al., 2022,
"FlashAttention: fast and memory-efficient exact attention with IO-awareness";
Dao, 2023, "FlashAttention-2", algorithms 1 and 2). Extra memory is ``O(L + S)``
per head plus one tile, not ``O(L * S)``.

Tiles that the mask leaves empty are skipped (block-sparse FlashAttention,
section 3.3 of the 2022 paper): a causal mask halves the work, a sliding window
makes it linear in ``L``. Tiles the pattern attends entirely skip the element mask.

This is exact attention: it equals :func:`attnlab.functional.sdpa_reference` up
to floating-point rounding, forward and backward.

Shape notation: ``N`` flattened batch, ``H`` query heads, ``L`` query length,
``S`` key length, ``E`` head dim, ``Ev`` value head dim.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnlab.backend_traits import TRAITS
from attnlab.backends.blocks import (
    MaskSpec,
    check_blockwise_call,
    compute_dtype,
    masked_scores,
    prologue,
    weights_from_lse,
)
from attnlab.backends.call import AttentionCall, Backend
from attnlab.backends.cost_model import Estimate, computed_pairs, estimate
from attnlab.backends.registry import register
from attnlab.functional.attention import empty_attention
from attnlab.functional.masks import MaskPattern

__all__ = ["BLOCK_K", "BLOCK_Q", "tiled_attention", "tiled_forward"]

#: Query rows per block. Large blocks amortise Python's per-tile overhead on CPU;
#: one tile's scores take ``N * H * BLOCK_Q * BLOCK_K`` floats.
BLOCK_Q = TRAITS["tiled"].tile()[0]
#: Keys per block (the unit of skipping).
BLOCK_K = TRAITS["tiled"].tile()[1]
#: Most keys met in one product: consecutive needed key blocks are merged up to this.
MAX_SPAN = 4096


def _tile_lists(
    spec: MaskSpec, block_q: int, block_k: int, device: torch.device, max_span: int | None = None
) -> list[list[tuple[int, int, bool]]]:
    """For each query block, the key spans ``(k0, k1, full)`` to visit.

    Consecutive needed key blocks of the same kind (fully attended, or needing the
    element mask) are merged into spans of up to ``MAX_SPAN`` keys: one larger product
    instead of several small ones, which matters on a CPU, where each kernel call has a
    fixed cost (a large one when other processes compete for the cores: every
    multi-threaded call waits for its slowest thread); and the element mask is applied
    only to the spans that need it (for a causal mask, the diagonal block: masking the
    whole merged row cost 8 % of the forward at 4096).
    """
    needed, full = spec.tiles(block_q, block_k, device)
    S = spec.kv_len
    per_span = max(1, (MAX_SPAN if max_span is None else max_span) // block_k)
    out: list[list[tuple[int, int, bool]]] = []
    for i in range(needed.shape[0]):
        cols = needed[i].nonzero().flatten().tolist()
        is_full = full[i].tolist()
        spans: list[tuple[int, int, bool]] = []
        start = 0
        while start < len(cols):
            end = start + 1
            while (
                end < len(cols)
                and end - start < per_span
                and cols[end] == cols[end - 1] + 1
                and is_full[cols[end]] == is_full[cols[start]]
            ):
                end += 1
            run = cols[start:end]
            k0, k1 = run[0] * block_k, min(S, (run[-1] + 1) * block_k)
            spans.append((k0, k1, all(is_full[j] for j in run)))
            start = end
        out.append(spans)
    return out


def tiled_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spec: MaskSpec,
    scale: float,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    max_span: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Forward pass with an online softmax.

    Args:
        q: ``[N, H, L, E]`` in the compute dtype.
        k: ``[N, H, S, E]`` (key heads already matched to the query heads).
        v: ``[N, H, S, Ev]``.
        spec: the call's mask.
        scale: score scale.
        block_q: query rows per block.
        block_k: keys per block.
        max_span: most keys per product (default :data:`MAX_SPAN`); ``block_k``
            visits every key block separately.

    Returns:
        ``(out [N, H, L, Ev], lse [N, H, L])``; a fully masked row has ``out = 0`` and
        ``lse = -inf``.
    """
    N, H, L, _ = q.shape
    Ev = v.shape[-1]
    out = q.new_zeros(N, H, L, Ev)
    lse = q.new_full((N, H, L), float("-inf"))
    tiles = _tile_lists(spec, block_q, block_k, q.device, max_span)
    for i, row in enumerate(tiles):
        if not row:
            continue
        q0, q1 = i * block_q, min(L, (i + 1) * block_q)
        qi = q[:, :, q0:q1] * scale  # [N, H, lq, E]
        m = q.new_full((N, H, q1 - q0, 1), float("-inf"))
        l = q.new_zeros(N, H, q1 - q0, 1)
        acc = q.new_zeros(N, H, q1 - q0, Ev)
        for k0, k1, full in row:
            s = torch.matmul(qi, k[:, :, k0:k1].transpose(-1, -2))  # [N, H, lq, lk]
            s, _ = spec.modify(s, q0, q1, k0, k1)
            s = masked_scores(s, spec, q0, q1, k0, k1, full)
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            m_safe = m_new.masked_fill(torch.isneginf(m_new), 0.0)
            p = s.sub_(m_safe).exp_()  # [N, H, lq, lk], unnormalised probabilities
            alpha = torch.exp(m - m_safe)  # rescales what was accumulated so far
            l = l.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))
            acc = acc.mul_(alpha).add_(torch.matmul(p, v[:, :, k0:k1]))
            m = m_new
        empty = l == 0
        out[:, :, q0:q1] = acc / l.masked_fill(empty, 1.0)
        m_fin = m.masked_fill(torch.isneginf(m), 0.0)
        row_lse = (m_fin + torch.log(l)).masked_fill(empty, float("-inf"))
        lse[:, :, q0:q1] = row_lse.squeeze(-1)
    return out, lse


def _tiled_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    spec: MaskSpec,
    scale: float,
    block_q: int,
    block_k: int,
    max_span: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """Backward pass: recompute each tile's probabilities from ``lse`` (FlashAttention-2, alg. 2).

    Returns ``(dq, dk, dv, grads of the score modifiers' parameters)``.
    """
    L = q.shape[2]
    delta = (dout * out).sum(dim=-1, keepdim=True)  # [N, H, L, 1]
    lse_safe = lse.masked_fill(torch.isneginf(lse), float("inf")).unsqueeze(-1)  # [N, H, L, 1]
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    learned = bool(spec.parameters)
    dparams = [torch.zeros_like(p, dtype=q.dtype) for p in spec.parameters]
    tiles = _tile_lists(spec, block_q, block_k, q.device, max_span)
    for i, row in enumerate(tiles):
        if not row:
            continue
        q0, q1 = i * block_q, min(L, (i + 1) * block_q)
        qi = q[:, :, q0:q1] * scale  # [N, H, lq, E]
        doi = dout[:, :, q0:q1]  # [N, H, lq, Ev]
        dqi = torch.zeros_like(qi)
        for k0, k1, full in row:
            kj, vj = k[:, :, k0:k1], v[:, :, k0:k1]
            raw = torch.matmul(qi, kj.transpose(-1, -2))  # [N, H, lq, lk]
            s, deriv = spec.modify(raw, q0, q1, k0, k1, derivative=not learned)
            s = masked_scores(s, spec, q0, q1, k0, k1, full)
            p = s.sub_(lse_safe[:, :, q0:q1]).exp_()  # normalised probabilities
            dv[:, :, k0:k1] += torch.matmul(p.transpose(-1, -2), doi)
            dp = torch.matmul(doi, vj.transpose(-1, -2))  # [N, H, lq, lk]
            ds = p.mul_(dp.sub_(delta[:, :, q0:q1]))  # dS = P * (dP - rowsum(dO * O))
            if learned:  # through the modifiers, to the scores and to their parameters
                ds, grads = spec.modify_backward(raw, q0, q1, k0, k1, ds)
                for acc_g, g in zip(dparams, grads, strict=True):
                    acc_g += g.to(acc_g.dtype)
            elif deriv is not None:  # through the score modifiers (chain rule)
                ds = ds.mul_(deriv)
            dqi += torch.matmul(ds, kj)
            dk[:, :, k0:k1] += torch.matmul(ds.transpose(-1, -2), qi)
        dq[:, :, q0:q1] = dqi * scale
    return dq, dk, dv, dparams


class _TiledAttention(torch.autograd.Function):
    """Autograd wrapper: saves ``q, k, v, out, lse`` (``O(L + S)``), recomputes tiles.

    The score modifiers' learned tensors (a T5 bias table) are passed as trailing
    inputs, so that autograd routes their gradients.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        spec: MaskSpec,
        scale: float,
        block_q: int,
        block_k: int,
        max_span: int | None,
        *params: Tensor,
    ) -> tuple[Tensor, Tensor]:
        dtype = q.dtype
        cdt = compute_dtype(dtype)
        qc, kc, vc = q.to(cdt), k.to(cdt), v.to(cdt)
        out, lse = tiled_forward(qc, kc, vc, spec, scale, block_q, block_k, max_span)
        ctx.save_for_backward(qc, kc, vc, out, lse)
        ctx.spec, ctx.scale, ctx.dtype = spec, scale, dtype
        ctx.blocks = (block_q, block_k, max_span)
        ctx.mark_non_differentiable(lse)
        return out.to(dtype), lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor, _dlse: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        qc, kc, vc, out, lse = ctx.saved_tensors
        dq, dk, dv, dparams = _tiled_backward(
            qc, kc, vc, out, lse, dout.to(qc.dtype), ctx.spec, ctx.scale, *ctx.blocks
        )
        d = ctx.dtype
        grads = [g.to(p.dtype) for g, p in zip(dparams, ctx.spec.parameters, strict=True)]
        return dq.to(d), dk.to(d), dv.to(d), None, None, None, None, None, *grads


def tiled_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | MaskPattern | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    return_weights: bool = False,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    max_span: int | None = None,
    q_positions: Tensor | None = None,
    k_positions: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Exact attention by tiles with an online softmax (FlashAttention-2 in PyTorch).

    Shapes and conventions as :func:`attnlab.functional.sdpa_reference`; ``attn_mask``
    may also be a :class:`~attnlab.functional.masks.MaskPattern`, whose empty tiles
    are skipped. ``dropout_p`` must be 0. ``q_positions`` ``[N|1, L]`` and
    ``k_positions`` ``[N|1, S]`` (``-1`` = empty key) place the queries and keys; the
    pattern, ``is_causal`` and the score modifiers are evaluated on them.

    Returns:
        ``(output [B.., H, L, Ev], weights [B.., H, L, S] or None)``; the weights are
        recomputed from the saved log-sum-exp.

    Raises:
        ValueError: ``dropout_p > 0``, or a pattern built for another batch size.
    """
    check_blockwise_call("tiled", attn_mask, dropout_p, needs_pattern=False)
    if query.shape[-2] == 0 or key.shape[-2] == 0:
        return empty_attention(query, key, value, return_weights=return_weights)
    q, k, v, spec, scale = prologue(
        query,
        key,
        value,
        attn_mask,
        is_causal,
        scale,
        q_positions=q_positions,
        k_positions=k_positions,
    )  # [N, H, *, E]
    out, lse = _TiledAttention.apply(
        q, k, v, spec, scale, block_q, block_k, max_span, *spec.parameters
    )
    out = out.reshape(*query.shape[:-1], value.shape[-1])  # [B.., H, L, Ev]
    weights = None
    if return_weights:
        cdt = compute_dtype(query.dtype)
        with torch.no_grad():
            w = weights_from_lse(q.to(cdt), k.to(cdt), lse, spec, scale)  # [N, H, L, S]
        weights = w.to(query.dtype).reshape(*query.shape[:-1], key.shape[-2])
    return out, weights


def _check(call: AttentionCall) -> str | None:
    if call.dropout_p > 0:
        return "does not apply dropout"
    if call.mask == "float" and call.mask_needs_grad:
        return "gives no gradient to a float mask"
    return None


def _cost(call: AttentionCall) -> Estimate | None:
    return estimate("tiled", call, computed_pairs(call, BLOCK_Q, BLOCK_K))


TILED = register(
    Backend(
        fn=tiled_attention,
        check=_check,
        cost=_cost,
        **TRAITS["tiled"].registry_fields(),
    )
)
