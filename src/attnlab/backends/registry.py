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

import torch
from torch import Tensor

from attnlab.backends.cost_model import Estimate
from attnlab.functional._checks import check_attention_inputs
from attnlab.functional.attention import AttnMask
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
    ) -> AttentionCall:
        if attn_mask is None:
            kind = "none"
        elif isinstance(attn_mask, MaskPattern):
            kind = "pattern"
        else:
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
        priority: breaks ties between equal estimates (lower first), and orders
            :func:`available`.
        description: one line for ``explain``.
        cost: estimated time of a call (see :mod:`attnlab.backends.cost_model`), or
            None; a backend without an estimate is chosen by ``auto`` only when no
            estimated backend can run the call.
    """

    name: str
    fn: BackendFn
    check: Callable[[AttentionCall], str | None]
    exact: bool = True
    accepts_patterns: bool = False
    priority: int = 100
    description: str = ""
    cost: Callable[[AttentionCall], Estimate | None] | None = None


@dataclass
class Explanation:
    """Why ``auto`` (or a forced backend) chose what it chose.

    Attributes:
        chosen: the backend that runs.
        reasons: for every registered backend, why it was chosen or passed over.
    """

    chosen: str
    reasons: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"backend: {self.chosen}"]
        lines += [f"  {name}: {why}" for name, why in self.reasons.items()]
        return "\n".join(lines)


_REGISTRY: dict[str, Backend] = {}
_FORCED: ContextVar[str | None] = ContextVar("attnlab_backend", default=None)


def register(backend: Backend) -> Backend:
    """Add (or replace) a backend in the registry."""
    if backend.name == "auto":
        raise ValueError("'auto' is reserved and cannot name a backend")
    _REGISTRY[backend.name] = backend
    return backend


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
    return Explanation(chosen, dict(sorted(reasons.items(), key=lambda kv: order[kv[0]])))


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
) -> Explanation:
    """Say which backend a call with these arguments would run, and why each other was not."""
    check_attention_inputs(
        query, key, value, enable_gqa=enable_gqa, dropout_p=dropout_p, scale=scale
    )
    call = AttentionCall.from_inputs(
        query,
        key,
        value,
        attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        enable_gqa=enable_gqa,
        return_weights=return_weights,
    )
    return _choose(call, backend)


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
) -> tuple[Tensor, Tensor | None]:
    """Run one (already validated) attention call on the chosen backend."""
    from attnlab.functional.attention import resolve_mask

    call = AttentionCall.from_inputs(
        query,
        key,
        value,
        attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        enable_gqa=enable_gqa,
        return_weights=return_weights,
    )
    b = get(_choose(call, backend).chosen)
    target = (*query.shape[:-1], key.shape[-2])  # [B.., H, L, S]
    mask = attn_mask
    if not (isinstance(attn_mask, MaskPattern) and b.accepts_patterns):
        mask = resolve_mask(attn_mask, target, device=query.device)
    return b.fn(
        query,
        key,
        value,
        mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        return_weights=return_weights,
    )
