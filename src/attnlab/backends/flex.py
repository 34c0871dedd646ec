"""The ``flex`` backend: torch's FlexAttention, compiled, fed with a pattern's block mask.

FlexAttention (PyTorch 2.5+, "FlexAttention: the flexibility of PyTorch with the
performance of FlashAttention", He et al., 2024) takes the same ``mask_mod``
predicate as :class:`~attnlab.functional.masks.MaskPattern`, turns it into a
``BlockMask`` (which ``128 x 128`` tiles are empty, full or partial) and generates
a fused kernel with ``torch.compile``: Triton on a GPU, C++ on a CPU. Uncompiled,
it materialises the whole score matrix, so this backend always compiles.

Compiling costs about 15 s per new shape on this project's CPU (about 2 s with a
warm inductor cache), and ``create_block_mask`` about 1 s the first time. Both are
cached here per (shapes, dtype, device, pattern): the first call for a shape logs a
warning that a compile is coming, and :func:`is_compiled` lets ``auto`` avoid a
backend whose next call would compile.

Limits of torch 2.13 on CPU (a GPU has neither): the compiled CPU kernel runs
inference only, which the check reports (gradients need another backend), and it
cannot return the log-sum-exp, so ``return_weights`` takes it from a ``tiled`` pass.

Shape notation: ``N`` flattened batch, ``H`` query heads, ``L`` query length,
``S`` key length, ``E`` head dim.
"""

from __future__ import annotations

import functools
import logging
import math
import shutil
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from attnlab.backend_traits import TRAITS
from attnlab.backends.blocks import check_blockwise_call, flatten_batch, mask_spec, weights_from_lse
from attnlab.backends.cost_model import Estimate, computed_pairs, estimate, lse_pass
from attnlab.backends.registry import AttentionCall, Backend, register
from attnlab.functional.attention import empty_attention, repeat_kv
from attnlab.functional.masks import MaskPattern

__all__ = ["BLOCK_SIZE", "COMPILE_SECONDS", "flex_attention", "is_compiled"]

logger = logging.getLogger(__name__)

#: FlexAttention's tile size (its default).
BLOCK_SIZE = TRAITS["flex"].tile()[0]
#: What a first call for a new shape costs on this project's CPU (cold inductor cache).
COMPILE_SECONDS = 15.0

_MAX_CACHED = 64
_compiled_fn: Callable[..., Any] | None = None
_block_masks: OrderedDict[tuple[Any, ...], tuple[MaskPattern | None, Any]] = OrderedDict()
_compiled_keys: set[tuple[Any, ...]] = set()
_score_fns: OrderedDict[int, tuple[MaskPattern | None, Callable[..., Tensor]]] = OrderedDict()


def _flex() -> Callable[..., Any]:
    """``torch.compile(flex_attention)``, built on first use (nothing happens at import)."""
    global _compiled_fn
    if _compiled_fn is None:
        from torch.nn.attention.flex_attention import flex_attention as _raw

        _compiled_fn = torch.compile(_raw, dynamic=False)
    return _compiled_fn


def _pattern_key(pattern: MaskPattern | None) -> int:
    return 0 if pattern is None else id(pattern)


def _shape_key(
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    v_shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    pattern: MaskPattern | None,
    is_causal: bool,
) -> tuple[Any, ...]:
    return (q_shape, k_shape, v_shape, dtype, str(device), _pattern_key(pattern), is_causal)


def is_compiled(call: AttentionCall) -> bool:
    """True when this backend has already run (compiled) a call of this shape and pattern."""
    key = _shape_key(
        call.query_shape,
        call.key_shape,
        call.value_shape,
        call.dtype,
        call.device,
        call.pattern,
        call.is_causal,
    )
    return key in _compiled_keys


def _block_mask(
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
    key = (_pattern_key(user_pattern), is_causal, batch, q_len, kv_len, str(device))
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


def _score_mod(pattern: MaskPattern | None) -> Callable[..., Tensor]:
    """One ``score_mod`` function per pattern: a new function object would recompile."""
    key = _pattern_key(pattern)
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


def flex_attention(
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
) -> tuple[Tensor, Tensor | None]:
    """Exact attention with compiled FlexAttention and the pattern's block mask.

    Shapes and conventions as :func:`attnlab.functional.sdpa_reference`; the mask
    must be a :class:`~attnlab.functional.masks.MaskPattern`, ``is_causal`` or None.

    Returns:
        ``(output [B.., H, L, Ev], weights [B.., H, L, S] or None)``.

    Raises:
        ValueError: a dense mask, ``dropout_p > 0``, or a pattern built for another batch size.
    """
    check_blockwise_call("flex", attn_mask, dropout_p, needs_pattern=True)
    if query.shape[-2] == 0 or key.shape[-2] == 0:
        return empty_attention(query, key, value, return_weights=return_weights)
    spec = mask_spec(attn_mask, is_causal, tuple(query.shape), key.shape[-2], device=query.device)
    q, k, v = flatten_batch(query), flatten_batch(key), flatten_batch(value)  # [N, H, *, E]
    n, L, S = q.shape[0], q.shape[2], k.shape[2]
    user_pattern = attn_mask if isinstance(attn_mask, MaskPattern) else None
    block_mask = None
    if spec.pattern is not None:
        block_mask = _block_mask(user_pattern, is_causal, spec.pattern, n, L, S, q.device)
    shape_key = _shape_key(
        tuple(query.shape),
        tuple(key.shape),
        tuple(value.shape),
        query.dtype,
        query.device,
        user_pattern,
        is_causal,
    )
    if shape_key not in _compiled_keys:
        logger.warning(
            "flex: compiling FlexAttention for query %s, key %s, %s on %s; the first call "
            "takes ~%.0f s (later calls of this shape reuse the kernel)",
            tuple(query.shape),
            tuple(key.shape),
            query.dtype,
            query.device,
            COMPILE_SECONDS,
        )
    scale_ = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    gqa = q.shape[1] != k.shape[1]
    cpu = q.device.type == "cpu"
    if gqa and cpu:
        # torch 2.13's compiled CPU kernel mixes up rows when enable_gqa meets a per-batch
        # block mask (a document pattern over 2 sequences, 4 query heads on 2 key heads:
        # wrong rows in the second sequence); sharing the key heads by repetition is exact.
        n_rep = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # [N, H, S, E]
        gqa = False
    score_mod = _score_mod(user_pattern) if spec.score_mods else None
    result = _flex()(
        q,
        k,
        v,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale_,
        enable_gqa=gqa,
        return_lse=return_weights and not cpu,
    )
    _compiled_keys.add(shape_key)
    weights = None
    if return_weights and cpu:
        # The compiled CPU kernel has no log-sum-exp output (torch 2.13): take it from
        # a tiled pass, O(L) memory, and recompute the weights from it.
        from attnlab.backends.weights import attention_weights

        out = result
        weights = attention_weights(query, key, attn_mask, is_causal, scale, enable_gqa)
    elif return_weights:
        out, lse = result
        kk = k if not gqa else k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        with torch.no_grad():
            w = weights_from_lse(q.float(), kk.float(), lse.float(), spec, scale_)
        weights = w.to(query.dtype).reshape(*query.shape[:-1], S)
    else:
        out = result
    return out.reshape(*query.shape[:-1], value.shape[-1]), weights


def _check(call: AttentionCall) -> str | None:
    if call.dropout_p > 0:
        return "does not apply dropout"
    if call.mask in ("bool", "float"):
        return "takes a mask pattern, got a dense mask"
    if call.positions:
        return "does not take q_positions/k_positions (its block mask is built per shape)"
    if call.dtype == torch.float64:
        return "FlexAttention's compiled kernels do not take float64"
    if call.device.type == "cpu":
        if call.needs_grad:
            return "compiled FlexAttention on CPU runs inference only (torch 2.13): no gradients"
        if not _have_cxx_compiler():
            return "torch.compile on CPU needs a C++ compiler, none on PATH"
    return None


@functools.cache
def _have_cxx_compiler() -> bool:
    """Whether a C++ compiler is on PATH; looked up once, not on every attention call."""
    return shutil.which("g++") is not None or shutil.which("c++") is not None


def _cost(call: AttentionCall) -> Estimate | None:
    est = estimate("flex", call, computed_pairs(call, BLOCK_SIZE, BLOCK_SIZE))
    if est is not None and call.return_weights and call.device.type == "cpu":
        est = Estimate(est.seconds + lse_pass(call), est.note + " + a tiled pass for the weights")
    if est is None or is_compiled(call):
        return est
    return Estimate(
        est.seconds + COMPILE_SECONDS,
        f"not compiled for this shape yet, first call costs ~{COMPILE_SECONDS:.0f} s "
        f"(then {est.note})",
    )


FLEX = register(
    Backend(
        fn=flex_attention,
        check=_check,
        cost=_cost,
        **TRAITS["flex"].registry_fields(),
    )
)
