"""The ``flex`` backend: torch's FlexAttention, compiled, fed with a pattern's block mask.

FlexAttention (PyTorch 2.5+, "FlexAttention: the flexibility of PyTorch with the
performance of FlashAttention", He et al., 2024) takes the same ``mask_mod``
predicate as :class:`~attnlab.functional.masks.MaskPattern`, turns it into a
``BlockMask`` (which ``128 x 128`` tiles are empty, full or partial) and generates
a fused kernel with ``torch.compile``: Triton on a GPU, C++ on a CPU. Uncompiled,
it materialises the whole score matrix, so this backend always compiles.

Compilation is dynamic in the sequence lengths, and this module keeps its own cache of
compiled kernels. With one static ``torch.compile`` object, dynamo stops compiling
after 8 shapes of a function (its recompile limit) and silently runs FlexAttention
uncompiled, which materialises the whole score matrix (+1.7 GiB at 4096 tokens,
killed for memory at 16384). Here each *kernel family* (pattern structure and
parameters, causality, dtype, device, head counts and dims, scale, score modifiers)
gets its own compiled entry point (its own code object, so its own dynamo cache and
recompile count): the first call compiles for its shape, a second length recompiles
once with the lengths dynamic (dynamo's automatic dynamic shapes), and every later
length reuses that kernel. The pattern's own integers (window sizes) stay constants:
torch 2.13's CPU FlexAttention template cannot take symbolic integer expressions in
a ``mask_mod``, which ``dynamic=True`` would make of them.

Never silently unfused: every entry point compiles with ``fullgraph=True``, so a graph
break or dynamo's recompile limit raises instead of falling back; a call whose family
would exceed :data:`MAX_FAMILIES`, or made while torch.compile is disabled, is refused
by the check (``auto`` passes ``flex`` over, a named call gets the reason) and by
:func:`flex_attention` itself (``RuntimeError``). :func:`compiled_kernels` counts the
graphs compiled.

A compile costs about 15 s on this project's CPU (about 2 s with a warm inductor
cache), and ``create_block_mask`` about 1 s the first time. Block masks are cached per
(pattern, lengths); a call that needs a compile logs a warning first, and
:func:`is_compiled` lets ``auto`` avoid a backend whose next call would compile.

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
import os
import shutil
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from attnlab.backend_traits import TRAITS
from attnlab.backends.blocks import check_blockwise_call, flatten_batch, mask_spec, weights_from_lse
from attnlab.backends.call import AttentionCall, Backend
from attnlab.backends.cost_model import Estimate, computed_pairs, estimate, lse_pass
from attnlab.backends.flex_masks import BLOCK_SIZE, cached_block_mask, cached_score_mod
from attnlab.backends.registry import forget_choices, register
from attnlab.functional.attention import empty_attention, repeat_kv
from attnlab.functional.masks import MaskPattern

__all__ = ["BLOCK_SIZE", "COMPILE_SECONDS", "compiled_kernels", "flex_attention", "is_compiled"]

logger = logging.getLogger(__name__)

#: What a first call for a new kernel costs on this project's CPU (cold inductor cache).
COMPILE_SECONDS = 15.0
#: Kernel families (see :func:`_family`) this backend compiles at most in one process;
#: a call that needs another is refused.
MAX_FAMILIES = 32
#: dynamo's recompile limit per family while this backend runs (dynamo's default is 8;
#: a family compiles once static, once dynamic, and once per size-1 specialisation).
_RECOMPILE_LIMIT = 16

#: One compiled entry point per kernel family.
_entries: dict[tuple[Any, ...], Callable[..., Any]] = {}
#: The shapes served so far, per family and size-1 specialisation (:func:`_kernel_key`):
#: the ``(L, S)`` pairs seen, or None once a second pair made the lengths dynamic.
_kernels: dict[tuple[Any, ...], set[tuple[int, int]] | None] = {}
#: Graphs dynamo actually compiled for this backend (counted around each call).
_graphs_compiled = 0
#: Set when dynamo refused to compile (its limits): why this backend refuses from then on.
_broken: str | None = None


def _call_flex(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    score_mod: Callable[..., Tensor] | None,
    block_mask: Any,
    scale: float,
    enable_gqa: bool,
    return_lse: bool,
) -> Any:
    """The function each kernel family compiles (a copy of its code object per family)."""
    from torch.nn.attention.flex_attention import flex_attention as _raw

    if return_lse:
        return _raw(
            q,
            k,
            v,
            score_mod=score_mod,
            block_mask=block_mask,
            scale=scale,
            enable_gqa=enable_gqa,
            return_lse=True,
        )
    return _raw(
        q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa
    )


def _mark_lengths_dynamic(q: Tensor, k: Tensor, v: Tensor, block_mask: Any) -> None:
    """Let dynamo compile the lengths and the block counts dynamic in one recompile.

    Called once a family has run at another length. Without it dynamo makes a size
    dynamic only after it changed, so the tile counts (fixed while the lengths stay
    within the same number of 128-tiles) would cost a third compile later.
    """
    for t in (q, k, v):
        torch._dynamo.maybe_mark_dynamic(t, t.dim() - 2)
    if block_mask is None:
        return
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        counts = getattr(block_mask, name, None)  # [B, H, tiles]
        if counts is not None:
            torch._dynamo.maybe_mark_dynamic(counts, counts.dim() - 1)
    for name in ("kv_indices", "full_kv_indices", "q_indices", "full_q_indices"):
        indices = getattr(block_mask, name, None)  # [B, H, tiles, tiles]
        if indices is not None:
            torch._dynamo.maybe_mark_dynamic(indices, indices.dim() - 1)
            torch._dynamo.maybe_mark_dynamic(indices, indices.dim() - 2)


def _entry(family: tuple[Any, ...]) -> Callable[..., Any]:
    """The compiled entry point of one kernel family, built on first use.

    dynamo keeps its compiled graphs, its recompile count and its record of which
    sizes changed per code object: a renamed copy of :func:`_call_flex`'s code per
    family keeps one family's lengths from making another's integers dynamic, and
    one family's shapes from spending another's recompile budget.
    """
    fn = _entries.get(family)
    if fn is None:
        name = f"_flex_family_{len(_entries)}"
        code = _call_flex.__code__.replace(co_name=name, co_qualname=name)
        copy = types.FunctionType(code, _call_flex.__globals__, name)
        fn = torch.compile(copy, fullgraph=True)  # dynamic=None: lengths dynamic on change
        _entries[family] = fn
    return fn


def _family(
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    v_shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    pattern: MaskPattern | None,
    is_causal: bool,
    scale: float | None,
    return_weights: bool,
) -> tuple[Any, ...]:
    """What one compiled kernel serves: every length, with the rest of the call fixed.

    The pattern's structure (kind and parameters, not its data), causality, dtype,
    device, head counts and dims, the scale, and whether the log-sum-exp is asked for.
    """
    h, e, h_kv, ev = q_shape[-3], q_shape[-1], k_shape[-3], v_shape[-1]
    structure = None if pattern is None else pattern.structure()
    lse = return_weights and device.type != "cpu"
    scale_ = 1.0 / math.sqrt(e) if scale is None else float(scale)
    return (structure, is_causal, dtype, str(device), h, h_kv, e, ev, scale_, lse)


def _kernel_key(family: tuple[Any, ...], q_shape: tuple[int, ...], kv_len: int) -> tuple[Any, ...]:
    """A family and the sizes dynamo specialises (1, a single tile, equal lengths)."""
    n, q_len = math.prod(q_shape[:-3]), q_shape[-2]
    special = (n == 1, q_len == 1, kv_len == 1, q_len <= BLOCK_SIZE, kv_len <= BLOCK_SIZE)
    return (*family, q_len == kv_len, *special)


def _served(key: tuple[Any, ...], q_len: int, kv_len: int) -> bool:
    """Whether a compiled kernel already serves these lengths (no compile on the next call)."""
    if key not in _kernels:
        return False
    seen = _kernels[key]
    return seen is None or (q_len, kv_len) in seen


def _note_served(key: tuple[Any, ...], q_len: int, kv_len: int) -> None:
    seen = _kernels.setdefault(key, set())
    if seen is not None:
        seen.add((q_len, kv_len))
        if len(seen) > 1:  # dynamo recompiled with the lengths dynamic
            _kernels[key] = None


def _call_keys(call: AttentionCall) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    family = _family(
        call.query_shape,
        call.key_shape,
        call.value_shape,
        call.dtype,
        call.device,
        call.pattern,
        call.is_causal,
        None,  # the call's description has no scale: judged for the default one
        call.return_weights,
    )
    return family, _kernel_key(family, call.query_shape, call.key_shape[-2])


def is_compiled(call: AttentionCall) -> bool:
    """True when a kernel this backend compiled already serves this call's lengths."""
    _, key = _call_keys(call)
    return _served(key, call.query_shape[-2], call.key_shape[-2])


def compiled_kernels() -> int:
    """Graphs dynamo compiled for this backend in this process (not one per length)."""
    return _graphs_compiled


def _compile_refusal(family: tuple[Any, ...], needs_compile: bool) -> str | None:
    """Why a call of kernel ``family`` cannot get a fused kernel now, or None if it can."""
    if _broken is not None:
        return _broken
    dynamo = sys.modules.get("torch._dynamo")  # not imported by a mere check: ~2 s
    if dynamo is None:
        if os.environ.get("TORCH_COMPILE_DISABLE", "0") == "1":
            return "torch.compile is disabled (TORCH_COMPILE_DISABLE=1); uncompiled it is unfused"
    else:
        if dynamo.config.disable:
            return (
                "torch.compile is disabled (torch._dynamo.config.disable); uncompiled it is unfused"
            )
        stance = getattr(getattr(dynamo.eval_frame, "_stance", None), "stance", "default")
        if stance == "force_eager" or (stance == "eager_on_recompile" and needs_compile):
            return f"torch.compiler.set_stance({stance!r}) would run FlexAttention unfused"
    if family not in _entries and len(_entries) >= MAX_FAMILIES:
        return (
            f"already compiled kernels for {len(_entries)} patterns/dtypes/layouts in this "
            f"process (its limit, {MAX_FAMILIES}; each serves every sequence length)"
        )
    return None


def _run_compiled(
    family: tuple[Any, ...],
    key: tuple[Any, ...],
    *args: Any,
) -> Any:
    """Run the family's compiled FlexAttention; count what it compiled; never run unfused.

    Args:
        family: the kernel family (:func:`_family`).
        key: the family with its size-1 specialisations (:func:`_kernel_key`).
        *args: :func:`_call_flex`'s arguments.
    """
    global _graphs_compiled, _broken
    from torch._dynamo.exc import FailOnRecompileLimitHit
    from torch._dynamo.utils import counters

    if torch.compiler.is_compiling():  # inside a caller's torch.compile: it fuses the call
        return _call_flex(*args)
    q, k = args[0], args[1]
    q_len, kv_len = q.shape[-2], k.shape[-2]
    if not _served(key, q_len, kv_len):
        logger.warning(
            "flex: compiling FlexAttention for query %s, key %s, %s (~%.0f s); once a "
            "pattern has run at two lengths its kernel serves every length",
            tuple(q.shape),
            tuple(k.shape),
            q.dtype,
            COMPILE_SECONDS,
        )
    if family in _entries:  # it ran before: this call's lengths may differ
        _mark_lengths_dynamic(q, k, args[2], args[4])
    before = counters["stats"]["unique_graphs"]
    try:
        with torch._dynamo.config.patch(
            recompile_limit=_RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True
        ):
            result = _entry(family)(*args)
    except FailOnRecompileLimitHit as e:
        _broken = (
            f"dynamo reached its recompile limit ({_RECOMPILE_LIMIT}) for one FlexAttention "
            "kernel; uncompiled it would materialise the score matrix"
        )
        forget_choices()
        raise RuntimeError(f"flex cannot get a fused FlexAttention kernel: {_broken}") from e
    finally:
        _graphs_compiled += counters["stats"]["unique_graphs"] - before
    _note_served(key, q_len, kv_len)
    return result


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
        RuntimeError: no fused kernel can be had (torch.compile disabled, or this
            backend's budget of kernel families, :data:`MAX_FAMILIES`, spent); it never
            runs unfused.
    """
    check_blockwise_call("flex", attn_mask, dropout_p, needs_pattern=True)
    if query.shape[-2] == 0 or key.shape[-2] == 0:
        return empty_attention(query, key, value, return_weights=return_weights)
    spec = mask_spec(attn_mask, is_causal, tuple(query.shape), key.shape[-2], device=query.device)
    q, k, v = flatten_batch(query), flatten_batch(key), flatten_batch(value)  # [N, H, *, E]
    n, L, S = q.shape[0], q.shape[2], k.shape[2]
    user_pattern = attn_mask if isinstance(attn_mask, MaskPattern) else None
    family = _family(
        tuple(query.shape),
        tuple(key.shape),
        tuple(value.shape),
        query.dtype,
        query.device,
        user_pattern,
        is_causal,
        scale,
        return_weights,
    )
    kernel = _kernel_key(family, tuple(query.shape), S)
    why = _compile_refusal(family, not _served(kernel, L, S))
    if why is not None:
        raise RuntimeError(f"flex cannot get a fused FlexAttention kernel for this call: {why}")
    block_mask = None
    if spec.pattern is not None:
        block_mask = cached_block_mask(user_pattern, is_causal, spec.pattern, n, L, S, q.device)
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
    score_mod = cached_score_mod(user_pattern) if spec.score_mods else None
    result = _run_compiled(
        family,
        kernel,
        q,
        k,
        v,
        score_mod,
        block_mask,
        scale_,
        gqa,
        return_weights and not cpu,
    )
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
    family, kernel = _call_keys(call)
    why = _compile_refusal(family, not _served(kernel, call.query_shape[-2], call.key_shape[-2]))
    if why is not None:
        return why
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
