"""The registry of attention backends: names, ``use()``, and the memo of choices.

Every backend is a :class:`~attnlab.backends.call.Backend` registered here by name. The
choice ``auto`` makes lives in :mod:`attnlab.backends.select`; running a call lives in
:mod:`attnlab.backends.dispatch`. This module holds only the store they share: the
backends, the backend :func:`use` forces inside a block, and the memo of choices (which
:func:`register` clears, since a new backend can change any choice).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from attnlab.backends.call import AttentionCall, Backend, BackendFn, Explanation

__all__ = [
    "AttentionCall",
    "Backend",
    "BackendFn",
    "Explanation",
    "available",
    "current",
    "forget_choices",
    "get",
    "register",
    "requested",
    "use",
]

_REGISTRY: dict[str, Backend] = {}
_FORCED: ContextVar[str | None] = ContextVar("attnlab_backend", default=None)


#: The backend chosen per call signature (see :func:`attnlab.backends.select.signature`),
#: and why; filled by :mod:`attnlab.backends.select`.
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


def requested(backend: str) -> str:
    """The backend a call asks for: a name, the one :func:`use` set, or ``"auto"``."""
    return backend if backend != "auto" else (_FORCED.get() or "auto")
