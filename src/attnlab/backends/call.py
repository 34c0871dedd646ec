"""The records of the attention layer: one call, one backend, one explanation.

Torch-light data shared by the registry (:mod:`.registry`), the choice
(:mod:`.select`), the dispatch (:mod:`.dispatch`) and the tools that describe attention
by its shapes (the cost model, the advisor). Shape notation as in
:mod:`attnlab.functional.attention`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from attnlab.backends.cost_model import Estimate
from attnlab.functional._checks import check_mask_kind
from attnlab.functional.attention import AttnMask
from attnlab.functional.masks import MaskPattern

__all__ = ["AttentionCall", "Backend", "BackendFn", "Explanation"]


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
