"""Attention maps for chosen heads and rows, without the full ``L x S`` matrix.

A picture of attention usually needs a few heads and a few query rows. This runs
the ``tiled`` forward (``O(L)`` extra memory), keeps its row log-sum-exp, and
recomputes only the requested weights from it (Dao, 2023, "FlashAttention-2":
the log-sum-exp is what the backward keeps for the same purpose).

Shape notation: ``B`` batch dims, ``H`` query heads, ``L`` query length, ``S`` key length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from attnlab.backends.blocks import compute_dtype, prologue, weights_from_lse
from attnlab.backends.tiled import tiled_forward
from attnlab.functional._checks import check_attention_inputs, check_positions
from attnlab.functional.masks import MaskPattern

__all__ = ["attention_weights"]


def _index(name: str, idx: Sequence[int] | Tensor | None, n: int) -> Tensor | None:
    if idx is None:
        return None
    t = torch.as_tensor(idx, dtype=torch.long).flatten()
    if t.numel() and (int(t.min()) < -n or int(t.max()) >= n):
        raise ValueError(f"{name} must lie in [0, {n}), got {t.tolist()}")
    return t.remainder(n)


def attention_weights(
    query: Tensor,
    key: Tensor,
    attn_mask: Tensor | MaskPattern | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    heads: Sequence[int] | Tensor | None = None,
    rows: Sequence[int] | Tensor | None = None,
    q_positions: Tensor | None = None,
    k_positions: Tensor | None = None,
) -> Tensor:
    """Softmax attention weights for the requested heads and query rows.

    Args:
        query: ``[B.., H, L, E]``.
        key: ``[B.., H_kv, S, E]``.
        attn_mask: dense mask or pattern, as for
            :func:`attnlab.scaled_dot_product_attention`.
        is_causal: causal mask (top-left).
        scale: score scale (default ``1/sqrt(E)``).
        enable_gqa: allow ``H_kv < H``.
        heads: query heads to return (default all).
        rows: query rows to return (default all).
        q_positions: long ``[B or 1, L]`` query positions (default ``arange(L)``).
        k_positions: long ``[B or 1, S]`` key positions, ``-1`` empty (default ``arange(S)``).

    Returns:
        ``[B.., len(heads), len(rows), S]``; equal to the corresponding slice of the
        reference's weights, with zeros for fully masked rows.

    Raises:
        ValueError: out-of-range heads or rows, or inputs that do not fit.
    """
    check_attention_inputs(query, key, key, enable_gqa=enable_gqa, dropout_p=0.0, scale=scale)
    q_positions, k_positions = check_positions(q_positions, k_positions, query, key)
    with torch.no_grad():
        # a 1-wide value: only the log-sum-exp of the forward is used
        q, k, one, spec, scale_ = prologue(
            query,
            key,
            key[..., :1],
            attn_mask,
            is_causal,
            scale,
            q_positions=q_positions,
            k_positions=k_positions,
            dtype=compute_dtype(query.dtype),
        )  # [N, H, *, E]
        _, lse = tiled_forward(q, k, one, spec, scale_)
        h_idx = _index("heads", heads, q.shape[1])
        r_idx = _index("rows", rows, q.shape[2])
        w = weights_from_lse(q, k, lse, spec, scale_, heads=h_idx, rows=r_idx)  # [N, h, r, S]
    lead = query.shape[:-3] if query.dim() > 3 else ()
    return w.to(query.dtype).reshape(*lead, *w.shape[1:]) if lead else w[0].to(query.dtype)
