"""What the ``flex`` backend builds once per pattern and keeps: block masks and score mods.

FlexAttention takes a ``BlockMask`` (which tiles of the score matrix are empty, full or
partial; ``create_block_mask`` costs about 1 s the first time) and a ``score_mod``
function, which must be the same function object on every call of a compiled kernel
(a new one recompiles). Both are cached here per pattern (by identity, the pattern kept
alive beside its entry so that its id is not reused) and, for block masks, per lengths.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from attnlab.backend_traits import TRAITS
from attnlab.functional.masks import MaskPattern

__all__ = ["BLOCK_SIZE", "cached_block_mask", "cached_score_mod", "pattern_key"]

#: FlexAttention's tile size (its default).
BLOCK_SIZE = TRAITS["flex"].tile()[0]

_MAX_CACHED = 64
_block_masks: OrderedDict[tuple[Any, ...], tuple[MaskPattern | None, Any]] = OrderedDict()
_score_fns: OrderedDict[int, tuple[MaskPattern | None, Callable[..., Tensor]]] = OrderedDict()


def pattern_key(pattern: MaskPattern | None) -> int:
    return 0 if pattern is None else id(pattern)


def cached_block_mask(
    user_pattern: MaskPattern | None,
    is_causal: bool,
    pattern: MaskPattern,
    n: int,
    q_len: int,
    kv_len: int,
    device: torch.device,
) -> Any:
    """The cached ``BlockMask`` of ``pattern`` (= ``user_pattern``, ``& causal()`` if asked)."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch = n if pattern.batch_dependent else None
    key = (pattern_key(user_pattern), is_causal, batch, q_len, kv_len, str(device))
    hit = _block_masks.get(key)
    if hit is not None:
        _block_masks.move_to_end(key)
        return hit[1]

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return pattern.mask_mod(b, h, q_idx, kv_idx)

    bm = create_block_mask(
        mask_mod, batch, None, q_len, kv_len, device=device, BLOCK_SIZE=BLOCK_SIZE
    )
    # Keep the user's pattern alive with its block mask, so that its id is not reused.
    _block_masks[key] = (user_pattern, bm)
    if len(_block_masks) > _MAX_CACHED:
        _block_masks.popitem(last=False)
    return bm


def cached_score_mod(pattern: MaskPattern | None) -> Callable[..., Tensor]:
    """One ``score_mod`` function per pattern: a new function object would recompile."""
    key = pattern_key(pattern)
    hit = _score_fns.get(key)
    if hit is not None:
        return hit[1]
    mods = pattern.score_mods if pattern is not None else ()

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        for m in mods:
            score = m(score, b, h, q_idx, kv_idx)
        return score

    _score_fns[key] = (pattern, score_mod)
    if len(_score_fns) > _MAX_CACHED:
        _score_fns.popitem(last=False)
    return score_mod
