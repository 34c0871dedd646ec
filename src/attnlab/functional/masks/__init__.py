"""Attention masks: dense helpers and structured patterns (one package, one concern per module).

Conventions (the same as ``torch.nn.functional.scaled_dot_product_attention``):
a boolean mask is ``True`` where a query may attend to a key; a floating mask is
added to the scores. Dense masks broadcast to the scores' shape ``(B, H, L, S)``
(``L`` query length, ``S`` key length).

Two kinds of objects live here:

* dense helpers that return tensors: :func:`causal_mask`, :func:`padding_mask`,
  :func:`lengths_mask`, :func:`combine`;
* structured patterns (:class:`MaskPattern`): :func:`causal`, :func:`sliding_window`,
  :func:`global_tokens`, :func:`dilated`, :func:`document`, :func:`prefix_lm`,
  :func:`padding`. A pattern is a predicate on absolute positions, in the spirit of
  FlexAttention's ``mask_mod``; patterns combine with ``&``, ``|`` and ``~``, are
  accepted as ``attn_mask=`` by every attention entry point, and can be made
  dense with :meth:`MaskPattern.to_dense` for tests and pictures. Backends that
  understand a pattern skip the blocks it masks out instead of building ``L x S``.

Positions: a pattern is a predicate on (query position, key position) pairs, where
a position is a token's slot in its row's sequence (left padding included). The
attention call says where its queries and keys sit (``q_positions`` ``[B|1, L]``,
``k_positions`` ``[B|1, S]``, ``-1`` for an empty key, see ``docs/contracts.md``);
:meth:`MaskPattern.evaluate` is the one function that evaluates a pattern on them,
used by ``to_dense``, by the tile geometry of :meth:`MaskPattern.block_mask` and by
every backend. Without positions, queries sit at ``q_offset + i`` and keys at ``j``:
``q_offset=0`` is torch's top-left alignment; cached decoding, where the ``L`` new
queries are the last ``L`` of ``S`` keys, uses ``q_offset = S - L`` (bottom-right
alignment, as FlashAttention >= 2.1).

The package: :mod:`~attnlab.functional.masks.dense` (tensors),
:mod:`~attnlab.functional.masks.algebra` (:class:`MaskPattern`, its evaluation and
combinations), :mod:`~attnlab.functional.masks.patterns` (the patterns),
:mod:`~attnlab.functional.masks.geometry` (tiles by position); their closed-form counts
for any length use the torch-free :mod:`attnlab.counting`.
"""

from attnlab.functional.masks.algebra import MaskMod, MaskPattern
from attnlab.functional.masks.dense import (
    causal_mask,
    combine,
    lengths_mask,
    padding_mask,
)
from attnlab.functional.masks.geometry import default_positions
from attnlab.functional.masks.patterns import (
    Causal,
    Dilated,
    Document,
    Full,
    GlobalTokens,
    Padding,
    PrefixLM,
    SlidingWindow,
    causal,
    dilated,
    document,
    full,
    global_tokens,
    padding,
    prefix_lm,
    sliding_window,
)

__all__ = [
    "Causal",
    "Dilated",
    "Document",
    "Full",
    "GlobalTokens",
    "MaskMod",
    "MaskPattern",
    "Padding",
    "PrefixLM",
    "SlidingWindow",
    "causal",
    "causal_mask",
    "combine",
    "default_positions",
    "dilated",
    "document",
    "full",
    "global_tokens",
    "lengths_mask",
    "padding",
    "padding_mask",
    "prefix_lm",
    "sliding_window",
]
