"""Statistics of attention weights, per layer and head.

Shape notation: ``B`` batch, ``H`` heads, ``L`` queries, ``S`` keys.

Row-wise measures (:func:`entropy`, :func:`attention_distance`,
:func:`first_token_share`), a per-token summary of one layer (:func:`summarize_heads`),
and per-head statistics over a batch (:func:`attention_head_stats`), which the
diagnostics and the pictures use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "HeadStats",
    "HeadSummary",
    "attention_distance",
    "attention_head_stats",
    "diagonal_share",
    "entropy",
    "first_token_share",
    "summarize_heads",
]


def entropy(weights: Tensor) -> Tensor:
    """Shannon entropy (nats) of each attention row: ``[.., L, S] -> [.., L]``; 0·log 0 = 0."""
    w = weights if weights.dtype == torch.float64 else weights.float()
    return -torch.special.xlogy(w, w).sum(-1).to(weights.dtype)  # xlogy(0, 0) = 0


def diagonal_share(weights: Tensor) -> float:
    """Mean weight a query puts on its own position (square ``[.., L, L]`` weights)."""
    if weights.shape[-1] != weights.shape[-2]:
        raise ValueError(f"diagonal_share needs square weights, got {tuple(weights.shape)}")
    return float(weights.diagonal(dim1=-2, dim2=-1).float().mean())


def attention_distance(weights: Tensor) -> Tensor:
    """Mean ``|i - j|`` of each row, weighted by attention: ``[.., L, S] -> [.., L]``.

    Queries are aligned bottom-right (the last query at the last key), which is the
    usual self-attention ``L == S`` and cached decoding alike. Local heads score low,
    heads that look far away high (Clark et al., 2019, "What does BERT look at?").
    """
    lq, s = weights.shape[-2], weights.shape[-1]
    w = weights if weights.dtype == torch.float64 else weights.float()
    qpos = torch.arange(lq, dtype=w.dtype, device=w.device).view(-1, 1) + (s - lq)
    dist = (qpos - torch.arange(s, dtype=w.dtype, device=w.device).view(1, -1)).abs()
    return (w * dist).sum(-1).to(weights.dtype)


def first_token_share(weights: Tensor) -> Tensor:
    """Weight each row puts on key 0: ``[.., L, S] -> [.., L]``.

    A head that parks most of its weight on the first token is an "attention sink"
    (Xiao et al., 2023, "Efficient streaming language models with attention sinks").
    """
    return weights[..., 0]


@dataclass
class HeadSummary:
    """What one head does on one input.

    Attributes:
        layer: layer index.
        head: head index.
        targets: for each query token, the token it attends to most.
        max_weights: that largest weight, per query token.
        mean_entropy: mean row entropy in nats (0 = one-hot, log S = uniform).
    """

    layer: int
    head: int
    targets: list[str]
    max_weights: list[float]
    mean_entropy: float


def summarize_heads(weights: Tensor, tokens: list[str], layer: int = 0) -> list[HeadSummary]:
    """Summarise each head of one layer's weights ``[H, L, L]`` for one sequence.

    Raises:
        ValueError: weights that are not ``[H, L, L]`` with ``L == len(tokens)``.
    """
    if weights.dim() != 3 or weights.shape[-1] != len(tokens) or weights.shape[-2] != len(tokens):
        raise ValueError(
            f"weights must be [heads, {len(tokens)}, {len(tokens)}] for {len(tokens)} tokens, "
            f"got {tuple(weights.shape)}"
        )
    best, idx = weights.float().max(dim=-1)  # [H, L]
    ent = entropy(weights.float()).mean(-1)  # [H]
    return [
        HeadSummary(
            layer=layer,
            head=h,
            targets=[tokens[j] for j in idx[h].tolist()],
            max_weights=best[h].tolist(),
            mean_entropy=float(ent[h]),
        )
        for h in range(weights.shape[0])
    ]


@dataclass
class HeadStats:
    """Attention statistics of one head of one layer, over the batch.

    Attributes:
        layer: layer index (order of the attention modules in the forward pass).
        module: the attention module's name.
        head: head index.
        row_sum_error: largest ``|sum_j w_ij - 1|`` over rows that are not fully masked.
        entropy: mean row entropy (nats) over rows that are not fully masked.
        max_weight: mean of each row's largest weight.
        first_token_share: mean weight on key 0 (an attention sink when large).
        fully_masked_rows: rows whose weights are all zero (every key masked).
        rows: rows seen (batch x queries).
        mean_distance: mean ``|i - j|`` weighted by attention (self-attention only).
    """

    layer: int
    module: str
    head: int
    row_sum_error: float
    entropy: float
    max_weight: float
    first_token_share: float
    fully_masked_rows: int
    rows: int
    mean_distance: float


def attention_head_stats(weights: Tensor, *, layer: int = 0, module: str = "") -> list[HeadStats]:
    """Statistics of each head of one layer's weights ``[B, H, L, S]`` (or ``[H, L, S]``).

    Raises:
        ValueError: weights that are not 3-D or 4-D.
    """
    if weights.dim() == 3:
        weights = weights.unsqueeze(0)
    if weights.dim() != 4:
        raise ValueError(f"weights must be [B, H, L, S] or [H, L, S], got {tuple(weights.shape)}")
    # float32 is plenty next to a row-sum tolerance of 1e-3 (float64 weights stay float64)
    w = weights.detach().float() if weights.dtype != torch.float64 else weights.detach()
    b, h, lq, _ = w.shape
    sums = w.sum(-1)  # [B, H, L]
    masked = sums == 0
    live = ~masked
    err = (sums - 1).abs().masked_fill(masked, 0.0)
    ent = entropy(w)  # [B, H, L]
    best = w.amax(-1)
    first = first_token_share(w)
    mean_dist = attention_distance(w)
    out: list[HeadStats] = []
    for head in range(h):
        lv = live[:, head]
        n_live = int(lv.sum())

        def mean(x: Tensor, lv: Tensor = lv, n_live: int = n_live) -> float:
            return float(x[lv].sum() / n_live) if n_live else 0.0

        out.append(
            HeadStats(
                layer=layer,
                module=module,
                head=head,
                row_sum_error=float(err[:, head].max()) if err.numel() else 0.0,
                entropy=mean(ent[:, head]),
                max_weight=mean(best[:, head]),
                first_token_share=mean(first[:, head]),
                fully_masked_rows=int(masked[:, head].sum()),
                rows=b * lq,
                mean_distance=mean(mean_dist[:, head]),
            )
        )
    return out
