"""Scaled dot-product attention: the reference math.

The public entry point, :func:`attnlab.scaled_dot_product_attention`, is defined above
the backends (:mod:`attnlab.backends.api`): this module never imports them.

Shape notation: ``B`` batch dims, ``H`` query heads, ``H_kv`` key/value heads,
``L`` query length, ``S`` key length, ``E`` query/key head dim, ``Ev`` value head dim.

The reference (:func:`sdpa_reference`) is written for clarity and exactness:
it upcasts float16/bfloat16 to float32, builds the full ``L x S`` score matrix
and is float64-capable. Every fast backend is tested against it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.functional._checks import check_dense_mask
from attnlab.functional.masks import MaskPattern, default_positions
from attnlab.functional.score_mods import ScoreMod

__all__ = ["empty_attention", "safe_softmax", "sdpa_reference"]

AttnMask = Tensor | MaskPattern | None


def safe_softmax(scores: Tensor, dim: int = -1) -> Tensor:
    """Softmax that returns zeros (not NaN) for a row whose entries are all ``-inf``.

    Gradients are finite everywhere: a fully masked row gets zero gradient.
    """
    row_max = scores.amax(dim=dim, keepdim=True)
    row_max = row_max.masked_fill(torch.isneginf(row_max), 0.0)
    e = torch.exp(scores - row_max)
    denom = e.sum(dim=dim, keepdim=True)
    return e / denom.masked_fill(denom == 0, 1.0)


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """Repeat key/value heads for grouped-query attention: ``[.., H_kv, S, E] -> [.., H_kv*n_rep, S, E]``."""
    if n_rep == 1:
        return x
    return x.repeat_interleave(n_rep, dim=-3)


def empty_attention(
    query: Tensor, key: Tensor, value: Tensor, *, return_weights: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Attention with no queries (``L = 0``) or no keys (``S = 0``).

    ``L = 0`` gives an empty output; ``S = 0`` gives zeros, as for a row whose keys are
    all masked. Computed as ``(Q K^T) V`` with an empty inner dimension, so the result
    stays connected to the inputs for autograd (their gradients are zeros).

    Returns:
        ``(output [B.., H, L, Ev], weights [B.., H, L, S] or None)``.
    """
    if query.dim() >= 4 and query.shape[-3] != key.shape[-3]:
        n_rep = query.shape[-3] // key.shape[-3]
        key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)  # [B.., H, S, E]
    weights = torch.matmul(query, key.transpose(-2, -1))  # [B.., H, L, S], empty
    return torch.matmul(weights, value), (weights if return_weights else None)


def position_grid(pos: Tensor, batch: tuple[int, ...], axis: str) -> Tensor:
    """Positions ``[P, n]`` shaped to broadcast against scores ``[B.., H, L, S]``.

    ``axis="q"`` gives ``[B.., 1, L, 1]`` and ``axis="k"`` ``[B.., 1, 1, S]``; one row
    (``P = 1``) drops the batch dims.
    """
    n = pos.shape[-1]
    lead = batch if pos.shape[0] > 1 else ()
    return pos.reshape((*lead, 1, n, 1) if axis == "q" else (*lead, 1, 1, n))


def pattern_mask(
    pattern: MaskPattern,
    target: tuple[int, ...],
    *,
    device: torch.device,
    q_positions: Tensor | None = None,
    k_positions: Tensor | None = None,
) -> Tensor:
    """A pattern evaluated at the call's positions, as a bool mask broadcasting to ``target``.

    ``target`` is the scores' shape ``(B.., H, L, S)``; positions default to
    ``arange`` (torch's top-left alignment).

    Raises:
        ValueError: a batch-dependent pattern built for another batch size.
    """
    batch = target[:-3]
    if pattern.batch_dependent:
        n = pattern.batch_size
        if len(batch) != 1 or batch[0] != n:
            raise ValueError(
                f"pattern {pattern!r} was built for batch size {n}, but the inputs have "
                f"batch dims {batch}"
            )
    L, S = target[-2], target[-1]
    qp = default_positions(L, device=device) if q_positions is None else q_positions
    kp = default_positions(S, device=device) if k_positions is None else k_positions
    dense = pattern.evaluate(qp, kp)  # [P, 1, L, S]
    if dense.shape[0] == 1:
        return dense[0]  # [1, L, S]
    return dense.reshape(*batch, 1, L, S)


def resolve_mask(
    attn_mask: AttnMask,
    target: tuple[int, ...],
    *,
    device: torch.device,
    q_positions: Tensor | None = None,
    k_positions: Tensor | None = None,
) -> Tensor | None:
    """Return ``attn_mask`` as a dense bool/float tensor that broadcasts to ``target``.

    ``target`` is the scores' shape ``(..., H, L, S)``; a pattern is evaluated at the
    call's positions (default: torch's top-left alignment, query ``i`` at position ``i``).
    A dense mask is indexed by array position and passes through unchanged.
    """
    if attn_mask is None:
        return None
    if isinstance(attn_mask, MaskPattern):
        return pattern_mask(
            attn_mask, target, device=device, q_positions=q_positions, k_positions=k_positions
        )
    return check_dense_mask(attn_mask, target)


def sdpa_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    return_weights: bool = False,
    q_offset: int = 0,
    score_mods: Sequence[ScoreMod] = (),
    q_positions: Tensor | None = None,
    k_positions: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The reference attention math: ``softmax(Q K^T * scale + mask) V``.

    Inputs are assumed valid (see :func:`scaled_dot_product_attention`). A query
    row with every key masked gets zero weights and a zero output.

    Args:
        query: ``[B.., H, L, E]``.
        key: ``[B.., H_kv, S, E]``.
        value: ``[B.., H_kv, S, Ev]``.
        attn_mask: dense bool (True = attend) or float (added) mask broadcasting to
            ``[B.., H, L, S]``.
        dropout_p: dropout on the attention weights (applied whenever > 0).
        is_causal: causal mask by position: query at ``p`` sees keys at ``<= p``.
        scale: score scale, default ``1/sqrt(E)``.
        enable_gqa: repeat key/value heads to the query heads.
        return_weights: also return the softmax weights (before dropout).
        q_offset: position of the first query when ``q_positions`` is None (0 = torch's
            top-left).
        score_mods: score modifiers (ALiBi, soft-capping, T5 bias) applied to the scaled
            scores before the mask, in order (see :mod:`attnlab.functional.score_mods`).
        q_positions: long ``[B or 1, L]``, each query's position (default
            ``q_offset + arange(L)``).
        k_positions: long ``[B or 1, S]``, each key's position, ``-1`` for an empty
            entry, never attended (default ``arange(S)``).

    Returns:
        ``(output [B.., H, L, Ev], weights [B.., H, L, S] or None)`` in the input dtype.
    """
    if query.shape[-2] == 0 or key.shape[-2] == 0:
        return empty_attention(query, key, value, return_weights=return_weights)
    out_dtype = query.dtype
    compute = torch.float32 if out_dtype in (torch.float16, torch.bfloat16) else out_dtype
    q, k, v = query.to(compute), key.to(compute), value.to(compute)
    if enable_gqa and q.dim() >= 4 and q.shape[-3] != k.shape[-3]:
        n_rep = q.shape[-3] // k.shape[-3]
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # [B.., H, S, E]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # [B.., H, L, S]
    L, S = scores.shape[-2], scores.shape[-1]
    dev = scores.device
    batch = tuple(scores.shape[:-3])
    qp = default_positions(L, offset=q_offset, device=dev) if q_positions is None else q_positions
    kp = default_positions(S, device=dev) if k_positions is None else k_positions
    qi = position_grid(qp, batch, "q")  # [B.., 1, L, 1]
    ki = position_grid(kp, batch, "k")  # [B.., 1, 1, S]
    if score_mods:
        n = math.prod(batch)
        b = torch.arange(n, device=dev).view(*batch, 1, 1, 1) if batch else None
        h = torch.arange(scores.shape[-3], device=dev).view(-1, 1, 1)  # [H, 1, 1]
        b = torch.zeros((), dtype=torch.long, device=dev) if b is None else b
        for mod in score_mods:
            scores = mod(scores, b, h, qi, ki)
    allowed: Tensor | None = None
    if is_causal:
        allowed = ki <= qi  # [B.., 1, L, S]
    if k_positions is not None:
        valid = ki >= 0  # an empty key is never attended
        allowed = valid if allowed is None else allowed & valid
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = attn_mask if allowed is None else allowed & attn_mask
        else:
            scores = scores + attn_mask.to(compute)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    weights = safe_softmax(scores, dim=-1)  # [B.., H, L, S]
    probs = F.dropout(weights, p=dropout_p, training=True) if dropout_p > 0 else weights
    out = torch.matmul(probs, v)  # [B.., H, L, Ev]
    return out.to(out_dtype), (weights.to(out_dtype) if return_weights else None)
