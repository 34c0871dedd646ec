"""Masks for decoding with a KV cache, built from explicit slots (bottom-right alignment).

Shape notation: ``B`` batch, ``L`` new queries, ``S`` keys, ``T`` slots so far.

A slot is a token's index in the decoded sequence (padding included). With a cache,
the ``L`` queries of a call hold slots ``start .. start+L-1`` and the cache returns
keys whose slots it names (see :mod:`attnlab.cache.kv_cache`), so the mask compares
slots, never array indices: query slot ``q`` sees key slot ``k`` when ``k <= q``
(and ``q - k < window`` for sliding-window attention), the key's token is not
padding, and the key's entry is not empty (slot ``-1``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.functional.masks import causal, sliding_window

__all__ = ["positions_from_mask", "slot_mask"]


def positions_from_mask(attention_mask: Tensor) -> Tensor:
    """Position ids of a left-padded batch: ``cumsum(mask) - 1``, padding set to 1.

    The convention of transformers' ``generate`` (and so of its checkpoints' users):
    the first real token of each row is position 0 whatever its padding.

    Args:
        attention_mask: ``[B, T]`` of 1 (token) / 0 (padding).

    Returns:
        Long ``[B, T]``.
    """
    m = attention_mask.long()
    return (m.cumsum(-1) - 1).masked_fill(m == 0, 1)


def slot_mask(
    q_slots: Tensor,
    k_slots: Tensor,
    *,
    attention_mask: Tensor | None = None,
    window: int | None = None,
) -> Tensor:
    """Bool mask ``[B or 1, 1, L, S]`` (True = attend) for causal attention by slot.

    Args:
        q_slots: long ``[L]``, the queries' slots.
        k_slots: long ``[S]``, the keys' slots; ``-1`` for an empty cache entry.
        attention_mask: ``[B, T]`` 1/0 over slots ``0..T-1``; slots beyond ``T`` count
            as padding (they are in the future of every query anyway).
        window: sliding-window size ``W`` (each query sees ``W`` keys, itself included),
            or None for full causal attention.

    Returns:
        Bool ``[B, 1, L, S]`` (``B = 1`` without ``attention_mask``).
    """
    pattern = causal() if window is None else sliding_window(window - 1)
    zero = torch.zeros((), dtype=torch.long, device=q_slots.device)
    allowed = pattern.mask_mod(zero, zero, q_slots[:, None], k_slots[None, :])  # [L, S]
    allowed = allowed & (k_slots >= 0)[None, :]
    if attention_mask is None:
        return allowed[None, None]  # [1, 1, L, S]
    t = attention_mask.shape[-1]
    inside = (k_slots >= 0) & (k_slots < t)  # [S]
    pad_ok = attention_mask.bool()[:, k_slots.clamp(0, max(t - 1, 0))] & inside  # [B, S]
    return allowed[None, None] & pad_ok[:, None, None, :]  # [B, 1, L, S]
