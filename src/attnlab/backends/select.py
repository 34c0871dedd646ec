"""``auto``'s choice: the exact backend with the lowest estimate, memoized per call kind.

A call is described by an :class:`~attnlab.backends.call.AttentionCall` (shapes, dtype,
mask kind and pattern structure, grad mode); each registered backend's ``check`` says
whether it can run it and its ``cost`` what it would take
(:mod:`attnlab.backends.cost_model`). ``auto`` takes the cheapest exact one (ties go to
the lower ``priority``); :func:`explain` returns the same decision with the reason each
other backend was passed over. The choice is remembered under one key layout
(:func:`_key`), whether the call comes from tensors (:func:`signature`) or from a
model's description (:func:`choose_call`): lengths bucketed, everything else exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from attnlab.backends.call import AttentionCall, Backend, Explanation
from attnlab.backends.cost_model import Estimate, gather_seconds
from attnlab.backends.registry import _MEMO, _REGISTRY, available, get, requested
from attnlab.functional._checks import check_attention_inputs, check_positions
from attnlab.functional.attention import AttnMask
from attnlab.functional.masks import MaskPattern

__all__ = ["bucket", "choose", "choose_call", "explain", "signature"]

_MEMO_MAX = 4096


def bucket(n: int) -> int:
    """A length's memo bucket: exact up to 16, then the next power of two.

    A decode step's key length grows by one each step; with buckets, the choice is
    made again only when the length crosses a power of two.
    """
    return n if n <= 16 else 1 << (n - 1).bit_length()


def signature(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: AttnMask,
    *,
    requested: str,
    dropout_p: float,
    is_causal: bool,
    enable_gqa: bool,
    return_weights: bool,
    positions: bool,
    block_size: int = 0,
) -> tuple[Any, ...]:
    """The memo key of a call: what ``auto``'s choice depends on, lengths bucketed.

    dtype, device, batch and head dims, mask kind and pattern structure (not its data),
    grad mode, and the bucketed query and key lengths (:func:`bucket`).
    """
    grad = torch.is_grad_enabled() and (
        query.requires_grad or key.requires_grad or value.requires_grad
    )
    if attn_mask is None:
        mask: Any = None
    elif isinstance(attn_mask, MaskPattern):
        mask = attn_mask.structure()
    else:
        mask_grad = attn_mask.requires_grad and torch.is_grad_enabled()
        grad = grad or mask_grad
        mask = (attn_mask.dtype == torch.bool, mask_grad)
    return _key(
        requested,
        query.shape,
        key.shape,
        value.shape[-1],
        query.dtype,
        query.device,
        mask,
        (is_causal, dropout_p > 0, enable_gqa, grad, return_weights, positions, block_size),
    )


def _key(
    requested: str,
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    value_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    mask: Any,
    flags: tuple[Any, ...],
) -> tuple[Any, ...]:
    """The one layout of a memo key (:func:`signature` from tensors, :func:`choose_call`
    from a model's call): lengths bucketed, everything else exact."""
    return (
        requested,
        dtype,
        device,
        tuple(q_shape[:-2]),
        k_shape[-3],
        q_shape[-1],
        value_dim,
        bucket(q_shape[-2]),
        bucket(k_shape[-2]),
        mask,
        *flags,
    )


def _remember(
    sig: tuple[Any, ...], lq: int, s: int, call: Callable[[], AttentionCall], backend: str
) -> tuple[Backend, Explanation]:
    """The memo's entry for ``sig``, or ``_choose(call(), backend)`` remembered now.

    A choice of ``flex`` is remembered for the exact lengths only: whether a shape is
    already compiled is part of its cost.
    """
    exact = (sig, lq, s)
    hit = _MEMO.get(sig) or _MEMO.get(exact)
    if hit is None:
        why = _choose(call(), backend)
        hit = (get(why.chosen), why)
        if len(_MEMO) >= _MEMO_MAX:
            _MEMO.clear()
        _MEMO[exact if why.chosen == "flex" else sig] = hit
    return hit


def choose(call: AttentionCall, backend: str = "auto") -> Explanation:
    """The backend that runs ``call`` and why, from a description alone (no tensors needed).

    What ``auto`` decides for a real call, for tools that describe attention by its
    shapes (the cost model, the advisor). Not memoized.

    Raises:
        ValueError: a named (or :func:`use`-set) backend that cannot run the call.
    """
    return _choose(call, backend)


def _choose(call: AttentionCall, backend: str) -> Explanation:
    asked = requested(backend)
    if asked != "auto":
        b = get(asked)
        why = b.check(call)
        if why is not None:
            source = "requested" if backend != "auto" else "set by attnlab.backends.use()"
            raise ValueError(f"backend {asked!r} ({source}) cannot run this call: {why}")
        others = {n: "not considered: a backend was named" for n in available() if n != asked}
        return Explanation(asked, {asked: "named explicitly", **others})
    reasons: dict[str, str] = {}
    estimates: dict[str, float] = {}
    runnable: list[tuple[float, int, str, Estimate | None]] = []
    for name in available():
        b = _REGISTRY[name]
        if not b.exact:
            reasons[name] = "approximate: chosen only by name, never by auto"
            continue
        why = b.check(call)
        if why is not None:
            reasons[name] = why
            continue
        est = b.cost(call) if b.cost is not None else None
        if est is not None and call.block_size and not b.reads_blocks:
            est = Estimate(
                est.seconds + gather_seconds(call), f"{est.note} + gathering the paged keys"
            )
        if est is not None:
            estimates[name] = est.seconds
        runnable.append((est.seconds if est else float("inf"), b.priority, name, est))
    if not runnable:  # the reference runs everything; only reached if it was replaced
        raise ValueError(f"no registered backend can run this call: {reasons}")
    runnable.sort(key=lambda r: (r[0], r[1]))
    best_s, _, chosen, best_est = runnable[0]
    b = _REGISTRY[chosen]
    what = f"chosen, {best_est.note}" if best_est else "chosen (no cost estimate)"
    reasons[chosen] = f"{what}: {b.description}" if b.description else what
    for seconds, _, name, est in runnable[1:]:
        if est is None:
            reasons[name] = "can run it, but has no cost estimate"
        elif best_s > 0 and math.isfinite(best_s):
            reasons[name] = f"{est.note}, {seconds / best_s:.1f}x the estimate of {chosen}"
        else:
            reasons[name] = f"{est.note}, slower than {chosen}"
    order = {n: i for i, n in enumerate(available())}
    ranked = dict(sorted(estimates.items(), key=lambda kv: kv[1]))
    return Explanation(chosen, dict(sorted(reasons.items(), key=lambda kv: order[kv[0]])), ranked)


def _memoized(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: AttnMask,
    *,
    backend: str,
    dropout_p: float,
    is_causal: bool,
    enable_gqa: bool,
    return_weights: bool,
    positions: bool,
    call: AttentionCall | None = None,
) -> tuple[Backend, Explanation]:
    """The backend for this call, from the memo or chosen (and remembered) now."""
    asked = requested(backend)
    sig = signature(
        query,
        key,
        value,
        attn_mask,
        requested=asked,
        dropout_p=dropout_p,
        is_causal=is_causal,
        enable_gqa=enable_gqa,
        return_weights=return_weights,
        positions=positions,
        block_size=call.block_size if call is not None else 0,
    )

    def described() -> AttentionCall:
        if call is not None:
            return call
        return AttentionCall.from_inputs(
            query,
            key,
            value,
            attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            enable_gqa=enable_gqa,
            return_weights=return_weights,
            positions=positions,
        )

    return _remember(sig, query.shape[-2], key.shape[-2], described, backend)


def choose_call(call: AttentionCall, backend: str = "auto") -> Explanation:
    """``auto``'s choice for a call a model described itself, memoized like every call.

    A model asks once per forward; the memo key is built from ``call`` alone (lengths
    bucketed, pattern structure not data), so every step of a decode hits the memo.
    """
    asked = requested(backend)
    if call.mask == "pattern" and call.pattern is not None:
        mask: Any = call.pattern.structure()
    elif call.mask == "none":
        mask = None
    else:
        mask = (call.mask == "bool", call.mask_needs_grad)
    flags = (
        call.is_causal,
        call.dropout_p > 0,
        call.enable_gqa,
        call.needs_grad or call.mask_needs_grad,
        call.return_weights,
        call.positions,
        call.block_size,
    )
    sig = _key(
        asked,
        call.query_shape,
        call.key_shape,
        call.value_shape[-1],
        call.dtype,
        call.device,
        mask,
        flags,
    )
    q_len, k_len = call.query_shape[-2], call.key_shape[-2]
    return _remember(sig, q_len, k_len, lambda: call, backend)[1]


def explain(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: AttnMask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    backend: str = "auto",
    return_weights: bool = False,
    q_positions: Tensor | None = None,
    k_positions: Tensor | None = None,
) -> Explanation:
    """Say which backend a call with these arguments would run, and why each other was not."""
    check_attention_inputs(
        query, key, value, enable_gqa=enable_gqa, dropout_p=dropout_p, scale=scale
    )
    check_positions(q_positions, k_positions, query, key)
    _, why = _memoized(
        query,
        key,
        value,
        attn_mask,
        backend=backend,
        dropout_p=dropout_p,
        is_causal=is_causal,
        enable_gqa=enable_gqa,
        return_weights=return_weights,
        positions=q_positions is not None or k_positions is not None,
    )
    return why
