"""Kernelised linear attention: the feature map and the quadratic-form reference.

Katharopoulos et al. (2020), "Transformers are RNNs: fast autoregressive
transformers with linear attention", replace ``exp(q . k)`` by ``phi(q) . phi(k)``
with a positive feature map ``phi(x) = elu(x) + 1``. Then

    out_i = sum_j phi(q_i) . phi(k_j) v_j / sum_j phi(q_i) . phi(k_j),

which, by associativity, costs ``O(L * E * Ev)`` instead of ``O(L * S)``. It is an
approximation of softmax attention, not equal to it.

This module holds the *quadratic form* of that formula (the ``L x S`` matrix of
``phi(q_i) . phi(k_j)``), written for clarity, against which the fast
``linear`` backend (:mod:`attnlab.backends.linear`) is tested.

Shape notation: ``B`` batch dims, ``H`` heads, ``L`` query length, ``S`` key
length, ``E`` head dim, ``Ev`` value head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["elu_feature_map", "linear_attention_reference"]


def elu_feature_map(x: Tensor) -> Tensor:
    """``elu(x) + 1``: positive, and the identity's slope for ``x > 0`` (Katharopoulos et al., 2020)."""
    return F.elu(x) + 1.0


def linear_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    is_causal: bool = False,
    key_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Linear attention in its quadratic form.

    Args:
        query: ``[B.., H, L, E]``.
        key: ``[B.., H, S, E]`` (heads already matched to the query).
        value: ``[B.., H, S, Ev]``.
        is_causal: query ``i`` sees keys ``j <= i`` (top-left, as torch).
        key_mask: bool ``[B.., 1|H, 1, S]``, True = the key takes part.
        scale: multiplies the queries before the feature map (default 1, as the paper).

    Returns:
        ``[B.., H, L, Ev]``; a query that sees no key gets zeros.
    """
    dtype = query.dtype
    cdt = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    q = elu_feature_map(query.to(cdt) * (1.0 if scale is None else scale))  # [B.., H, L, E]
    k = elu_feature_map(key.to(cdt))  # [B.., H, S, E]
    a = torch.matmul(q, k.transpose(-1, -2))  # [B.., H, L, S]
    L, S = a.shape[-2], a.shape[-1]
    if is_causal:
        keep = torch.ones(L, S, dtype=torch.bool, device=a.device).tril()
        a = a.masked_fill(~keep, 0.0)
    if key_mask is not None:
        a = a.masked_fill(~key_mask, 0.0)
    denom = a.sum(dim=-1, keepdim=True)  # [B.., H, L, 1]
    out = torch.matmul(a, value.to(cdt)) / denom.masked_fill(denom == 0, 1.0)
    return out.to(dtype)
