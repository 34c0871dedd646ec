"""Pooling token states into one vector per sequence (sentence embeddings).

The token states of several sequences may lie in one tensor in any layout: padded
rows (one sequence per row) or packed rows (several sequences per row, one after
another). Flattened, every slot carries the index of the sequence it belongs to
(``segments``, ``-1`` for padding), and the pooling is a segmented reduction; so
padded and packed runs pool with the same code and give the same numbers.

The modes are those of sentence-transformers' ``Pooling`` module (Reimers &
Gurevych, 2019, "Sentence-BERT"):

* ``mean``: the mean of a sequence's token states;
* ``cls``: the state of its first token ([CLS]);
* ``max``: the element-wise maximum over its tokens;
* ``mean_sqrt_len``: the sum divided by ``sqrt(number of tokens)``.

Shape notation: ``T`` token slots, ``D`` width, ``N`` sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["normalize", "pool_segments"]

_MODES = ("cls", "max", "mean", "mean_sqrt_len")


def pool_segments(
    hidden: Tensor, segments: Tensor, num_segments: int, modes: tuple[str, ...] = ("mean",)
) -> Tensor:
    """Pool token states per sequence.

    Args:
        hidden: ``[T, D]`` token states (any float dtype; pooled in float32 or float64).
        segments: ``[T]`` long, the sequence of each slot in ``0..N-1``, ``-1`` for
            slots that belong to none (padding). A sequence's tokens appear in order.
        num_segments: ``N``; every sequence must own at least one slot.
        modes: pooling modes, concatenated in the given order.

    Returns:
        ``[N, D * len(modes)]`` in float32 (float64 for float64 input).

    Raises:
        ValueError: shapes that do not fit, an unknown mode, or a sequence with no token.
    """
    if hidden.dim() != 2 or segments.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden must be [T, D] and segments [T], got {tuple(hidden.shape)} and "
            f"{tuple(segments.shape)}"
        )
    bad = [m for m in modes if m not in _MODES]
    if bad or not modes:
        raise ValueError(f"pooling modes must be a non-empty tuple from {_MODES}, got {modes!r}")
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    keep = segments >= 0
    seg = segments[keep]  # [T']
    h = hidden[keep].to(dtype)  # [T', D]
    d = h.shape[-1]
    counts = torch.bincount(seg, minlength=num_segments)[:num_segments]  # [N]
    if bool((counts == 0).any()):
        empty = (counts == 0).nonzero().flatten().tolist()
        raise ValueError(f"sequences {empty[:10]} have no token to pool")
    out: list[Tensor] = []
    total: Tensor | None = None
    for mode in modes:
        if mode == "cls":
            slot = torch.arange(seg.shape[0], device=seg.device)
            first = torch.full((num_segments,), seg.shape[0], dtype=torch.long, device=seg.device)
            first = first.scatter_reduce(0, seg, slot, reduce="amin")  # [N]
            out.append(h[first])
        elif mode == "max":
            init = torch.full((num_segments, d), float("-inf"), dtype=dtype, device=h.device)
            idx = seg.unsqueeze(-1).expand(-1, d)
            out.append(init.scatter_reduce(0, idx, h, reduce="amax"))
        else:
            if total is None:
                total = torch.zeros(num_segments, d, dtype=dtype, device=h.device)
                total.index_add_(0, seg, h)  # [N, D]
            n = counts.to(dtype).unsqueeze(-1)  # [N, 1]
            out.append(total / n if mode == "mean" else total / n.sqrt())
    return out[0] if len(out) == 1 else torch.cat(out, dim=-1)


def normalize(x: Tensor) -> Tensor:
    """L2-normalise the last dimension (``eps = 1e-12``, as ``torch.nn.functional.normalize``)."""
    return F.normalize(x, p=2.0, dim=-1)
