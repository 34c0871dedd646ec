"""One registry of attention backends, one signature, and an ``auto`` that explains itself.

Every backend is a :class:`Backend`: a function with the signature of
:func:`attnlab.functional.sdpa_reference` (dense mask already resolved, or a
:class:`~attnlab.functional.masks.MaskPattern` for backends that understand
patterns) and a ``check`` that says, for one call, why the backend cannot run it
(or ``None`` when it can), and a ``cost`` that estimates its time for the call
from measured constants (:mod:`attnlab.backends.cost_model`). ``auto`` takes the
exact backend with the lowest estimate among those whose check passes (ties go
to the lower ``priority``); :func:`explain` returns the same decision with the
reason each other backend was passed over.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from attnlab.backends.cost_model import Estimate, gather_seconds
from attnlab.functional._checks import check_attention_inputs, check_mask_kind, check_positions
from attnlab.functional.attention import AttnMask, pattern_mask, resolve_mask
from attnlab.functional.masks import MaskPattern


@dataclass(frozen=True)
class AttentionCall:
    """What a backend needs to know about one call to decide whether it can run it."""

    query_shape: tuple[int, ...]
    key_shape: tuple[int, ...]
    value_shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    mask: str  # "none", "bool", "float", or "pattern"
    pattern: MaskPattern | None
    is_causal: bool
    dropout_p: float
    enable_gqa: bool
    needs_grad: bool
    return_weights: bool
    mask_needs_grad: bool = False
    positions: bool = False  # the call says where its queries/keys sit (q/k_positions)
    #: the keys live in a paged pool of blocks of this many tokens (0: a batch of keys);
    #: backends that read blocks (``paged``) can run it, the others get the gathered batch
    block_size: int = 0

    @classmethod
    def from_inputs(
        cls,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: AttnMask,
        *,
        dropout_p: float,
        is_causal: bool,
        enable_gqa: bool,
        return_weights: bool,
        positions: bool = False,
    ) -> AttentionCall:
        """Describe one call; ``positions`` says whether it carries q/k positions."""
        if attn_mask is None:
            kind = "none"
        elif isinstance(attn_mask, MaskPattern):
            kind = "pattern"
        else:
            check_mask_kind(attn_mask)  # a list or an array: named, before .dtype is read
            kind = "bool" if attn_mask.dtype == torch.bool else "float"
        needs_grad = (
            torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        ) or (isinstance(attn_mask, Tensor) and attn_mask.requires_grad and torch.is_grad_enabled())
        return cls(
            query_shape=tuple(query.shape),
            key_shape=tuple(key.shape),
            value_shape=tuple(value.shape),
            dtype=query.dtype,
            device=query.device,
            mask=kind,
            pattern=attn_mask if isinstance(attn_mask, MaskPattern) else None,
            is_causal=is_causal,
            dropout_p=dropout_p,
            enable_gqa=enable_gqa,
            needs_grad=bool(needs_grad),
            return_weights=return_weights,
            mask_needs_grad=bool(
                isinstance(attn_mask, Tensor)
                and attn_mask.requires_grad
                and torch.is_grad_enabled()
            ),
            positions=positions,
        )


BackendFn = Callable[..., tuple[Tensor, Tensor | None]]


@dataclass(frozen=True)
class Backend:
    """A registered attention backend.

    Attributes:
        name: the name users pass as ``backend=``.
        fn: ``fn(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
            *, return_weights) -> (output, weights | None)``.
        check: returns why the backend cannot run a call, or ``None`` if it can.
        exact: False for approximations (never chosen by ``auto``).
        accepts_patterns: True if ``fn`` takes a MaskPattern directly; otherwise the
            dispatcher passes the dense mask.
        accepts_positions: True if ``fn`` takes ``q_positions``/``k_positions``; otherwise
            the dispatcher folds them (with the pattern, ``is_causal`` and the empty
            keys) into a dense mask, or the backend's check refuses calls with positions.
        priority: breaks ties between equal estimates (lower first), and orders
            :func:`available`.
        description: one line for ``explain``.
        cost: estimated time of a call (see :mod:`attnlab.backends.cost_model`), or
            None; a backend without an estimate is chosen by ``auto`` only when no
            estimated backend can run the call.
        trusted_fn: ``fn`` without its data-dependent input checks (a host sync), for
            the library's trusted path (:func:`dispatch_trusted`), whose caller checks
            its own outputs; None when ``fn`` has no such check.
        reads_blocks: ``fn`` takes a paged cache's pools as ``key``/``value`` and its
            block tables as ``block_table=`` (only for calls with a ``block_size``).
    """

    name: str
    fn: BackendFn
    check: Callable[[AttentionCall], str | None]
    exact: bool = True
    accepts_patterns: bool = False
    accepts_positions: bool = False
    priority: int = 100
    description: str = ""
    cost: Callable[[AttentionCall], Estimate | None] | None = None
    trusted_fn: BackendFn | None = None
    reads_blocks: bool = False


@dataclass
class Explanation:
    """Why ``auto`` (or a forced backend) chose what it chose.

    Attributes:
        chosen: the backend that runs.
        reasons: for every registered backend, why it was chosen or passed over.
    """

    chosen: str
    reasons: dict[str, str] = field(default_factory=dict)
    #: Estimated seconds of each backend that can run the call (the ranking, as data).
    estimates: dict[str, float] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"backend: {self.chosen}"]
        lines += [f"  {name}: {why}" for name, why in self.reasons.items()]
        return "\n".join(lines)


_REGISTRY: dict[str, Backend] = {}
_FORCED: ContextVar[str | None] = ContextVar("attnlab_backend", default=None)


#: The backend chosen per call signature (see :func:`signature`), and why.
_MEMO: dict[tuple[Any, ...], tuple[Backend, Explanation]] = {}
_MEMO_MAX = 4096


def register(backend: Backend) -> Backend:
    """Add (or replace) a backend in the registry (and forget the memoized choices)."""
    if backend.name == "auto":
        raise ValueError("'auto' is reserved and cannot name a backend")
    _REGISTRY[backend.name] = backend
    _MEMO.clear()
    return backend


def forget_choices() -> None:
    """Forget every memoized choice (a backend's ability to run calls has changed)."""
    _MEMO.clear()


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


def available() -> list[str]:
    """Names of the registered backends, in ``auto``'s order of preference."""
    return [b.name for b in sorted(_REGISTRY.values(), key=lambda b: b.priority)]


def get(name: str) -> Backend:
    """Return the backend called ``name``; raise ``ValueError`` naming the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; known: {['auto', *available()]}"
        ) from None


@contextlib.contextmanager
def use(name: str) -> Iterator[None]:
    """Make ``auto`` resolve to ``name`` inside the block (like ``torch.nn.attention.sdpa_kernel``).

    Explicit ``backend=NAME`` arguments are not overridden. ``use("auto")`` restores
    automatic choice inside an outer ``use``.
    """
    if name != "auto":
        get(name)
    token = _FORCED.set(None if name == "auto" else name)
    try:
        yield
    finally:
        _FORCED.reset(token)


def current() -> str:
    """The backend ``auto`` resolves to in this context (``"auto"`` if none is set)."""
    return _FORCED.get() or "auto"


def choose(call: AttentionCall, backend: str = "auto") -> Explanation:
    """The backend that runs ``call`` and why, from a description alone (no tensors needed).

    What ``auto`` decides for a real call, for tools that describe attention by its
    shapes (the cost model, the advisor). Not memoized.

    Raises:
        ValueError: a named (or :func:`use`-set) backend that cannot run the call.
    """
    return _choose(call, backend)


def _choose(call: AttentionCall, backend: str) -> Explanation:
    requested = backend if backend != "auto" else (_FORCED.get() or "auto")
    if requested != "auto":
        b = get(requested)
        why = b.check(call)
        if why is not None:
            source = "requested" if backend != "auto" else "set by attnlab.backends.use()"
            raise ValueError(f"backend {requested!r} ({source}) cannot run this call: {why}")
        others = {n: "not considered: a backend was named" for n in available() if n != requested}
        return Explanation(requested, {requested: "named explicitly", **others})
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
    requested = backend if backend != "auto" else (_FORCED.get() or "auto")
    sig = signature(
        query,
        key,
        value,
        attn_mask,
        requested=requested,
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
    requested = backend if backend != "auto" else (_FORCED.get() or "auto")
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
        requested,
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


def _positions_mask(
    is_causal: bool,
    attn_mask: AttnMask,
    target: tuple[int, ...],
    device: torch.device,
    q_positions: Tensor | None,
    k_positions: Tensor | None,
) -> Tensor | None:
    """For a backend without positions: pattern, ``is_causal`` and empty keys as one dense mask."""
    from attnlab.functional.masks import causal, combine, full

    pattern = attn_mask._unscored() if isinstance(attn_mask, MaskPattern) else None
    dense = None if isinstance(attn_mask, MaskPattern) else attn_mask
    if is_causal:
        pattern = causal() if pattern is None else pattern & causal()
    if pattern is None and k_positions is not None:
        pattern = full()  # the empty keys (-1) still have to be masked
    by_pos = None
    if pattern is not None:
        by_pos = pattern_mask(
            pattern, target, device=device, q_positions=q_positions, k_positions=k_positions
        )
    return combine(resolve_mask(dense, target, device=device), by_pos)


def _run(
    b: Backend,
    is_causal: bool,
    dropout_p: float,
    enable_gqa: bool,
    return_weights: bool,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: AttnMask,
    scale: float | None,
    q_positions: Tensor | None,
    k_positions: Tensor | None,
    trusted: bool = False,
    block_table: object | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Hand one call to backend ``b``, in the form of mask and positions it takes
    (``trusted``: the library's own call, without the backend's data checks)."""
    target = (*query.shape[:-1], key.shape[-2])  # [B.., H, L, S]
    extra: dict[str, object] = {}
    positions = q_positions is not None or k_positions is not None
    if positions and b.accepts_positions:
        extra = {"q_positions": q_positions, "k_positions": k_positions}
    if b.reads_blocks:
        extra["block_table"] = block_table
    mask = attn_mask
    if positions and not b.accepts_positions:
        mask = _positions_mask(is_causal, attn_mask, target, query.device, q_positions, k_positions)
        is_causal = False
    elif not (isinstance(attn_mask, MaskPattern) and b.accepts_patterns):
        mask = resolve_mask(
            attn_mask, target, device=query.device, q_positions=q_positions, k_positions=k_positions
        )
    fn = b.trusted_fn if trusted and b.trusted_fn is not None else b.fn
    return fn(
        query,
        key,
        value,
        mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        return_weights=return_weights,
        **extra,
    )


def dispatch(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: AttnMask,
    *,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    backend: str,
    return_weights: bool,
    q_positions: Tensor | None = None,
    k_positions: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Run one (already validated) attention call on the backend memoized for its signature."""
    b, _ = _memoized(
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
    return _run(
        b,
        is_causal,
        dropout_p,
        enable_gqa,
        return_weights,
        query,
        key,
        value,
        attn_mask,
        scale,
        q_positions,
        k_positions,
    )


def dispatch_trusted(
    call: AttentionCall,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    *,
    scale: float | None = None,
    backend: str = "auto",
    q_positions: Tensor | None = None,
    k_positions: Tensor | None = None,
    block_table: object | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Run a call described once by ``call`` (the library's internal path: no re-validation).

    A model builds one :class:`AttentionCall` per forward (shapes, dtype, mask kind,
    pattern, grad mode) and every layer runs through it; the inputs were validated at
    the entry the user called (``docs/contracts.md``, section 1).

    Args:
        call: the call's description; its ``pattern`` is the mask when ``attn_mask`` is None.
        query: ``[B.., H, L, E]``.
        key: ``[B.., H_kv, S, E]``.
        value: ``[B.., H_kv, S, Ev]``.
        attn_mask: a dense mask (when ``call.mask`` is ``"bool"`` or ``"float"``).
        scale: score scale (default ``1/sqrt(E)``).
        backend: ``"auto"`` or a backend name.
        q_positions: long ``[B or 1, L]`` query positions, or None.
        k_positions: long ``[B or 1, S]`` key positions (``-1`` empty), or None.
        block_table: for a backend that reads blocks (``call.block_size > 0``), the
            rows' block tables; ``key``/``value`` are then the layer's pools.

    Returns:
        ``(output [B.., H, L, Ev], weights or None)``.
    """
    mask: AttnMask = call.pattern if attn_mask is None else attn_mask
    if backend != "auto":  # a name (a model resolves its backend once per forward)
        b = get(backend)
    else:
        b, _ = _memoized(
            query,
            key,
            value,
            mask,
            backend=backend,
            dropout_p=call.dropout_p,
            is_causal=call.is_causal,
            enable_gqa=call.enable_gqa,
            return_weights=call.return_weights,
            positions=call.positions,
            call=call,
        )
    return _run(
        b,
        call.is_causal,
        call.dropout_p,
        call.enable_gqa,
        call.return_weights,
        query,
        key,
        value,
        mask,
        scale,
        q_positions,
        k_positions,
        trusted=True,
        block_table=block_table,
    )
