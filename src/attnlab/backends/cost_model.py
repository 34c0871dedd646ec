"""The cost model behind ``auto``: how long each backend would take for one call.

Every exact backend does work proportional to the number of (query, key) pairs it
computes, times the head dims: ``units = N * H * pairs * (E + Ev) / 128`` (one unit
is one pair of one head at head dim 64). What differs is *which* pairs a backend
computes and how fast it goes through them:

* ``reference`` and ``sdpa`` with a mask compute all ``L * S`` pairs (``sdpa``'s
  flash kernel skips the upper triangle when ``is_causal`` is the only mask, and
  has its own constants);
* ``tiled`` and ``flex`` compute the tiles the pattern touches (``256 x 256`` and
  ``128 x 128``);
* ``sparse`` computes the ``64``-wide key blocks each query block gathers.

The estimate is ``overhead + units * seconds_per_unit``, with one pair of constants
per backend, per pass (forward, or forward + backward) and per device type,
measured on this project's machine (:mod:`attnlab.backends.cost_constants`).
Tile counts come from :meth:`MaskPattern.block_mask` (cached), so the model sees
that a sliding window leaves most tiles empty, without building a mask.

Shape notation as in :mod:`attnlab.functional.attention`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from attnlab.backend_traits import PAGED_COST, TRAITS
from attnlab.backends import cost_constants
from attnlab.functional.masks import MaskPattern, causal

if TYPE_CHECKING:
    from attnlab.backends.call import AttentionCall

__all__ = [
    "Estimate",
    "computed_pairs",
    "estimate",
    "format_seconds",
    "gather_seconds",
    "lse_pass",
    "units",
]

_MAX_CACHED = 128
_pairs_cache: OrderedDict[tuple[object, ...], tuple[MaskPattern | None, float]] = OrderedDict()


@dataclass(frozen=True)
class Estimate:
    """A backend's estimated time for one call.

    Attributes:
        seconds: estimated wall time.
        note: what the estimate assumes (shown by ``explain``).
    """

    seconds: float
    note: str = ""


def format_seconds(seconds: float) -> str:
    """``0.0123 -> "12.3 ms"``, ``5.2 -> "5.2 s"``."""
    if seconds >= 1.0:
        return f"{seconds:.3g} s"
    return f"{seconds * 1e3:.3g} ms"


def units(call: AttentionCall, pairs: float) -> float:
    """Work units of ``pairs`` (query, key) pairs per head: ``N * H * pairs * (E + Ev) / 128``."""
    q, v = call.query_shape, call.value_shape
    n_h = math.prod(q[:-2])
    return n_h * pairs * (q[-1] + v[-1]) / 128.0


def computed_pairs(call: AttentionCall, block_q: int, block_k: int) -> float:
    """Pairs per head a block-sparse backend with ``block_q x block_k`` tiles computes.

    A call that carries positions (a model's) has its queries at the newest slots,
    ``S - L .. S - 1`` (a decode step or a prefill chunk after a cache); without them,
    at ``0 .. L - 1`` (torch's ``is_causal`` convention).
    """
    L, S = call.query_shape[-2], call.key_shape[-2]
    pattern = call.pattern._unscored() if call.pattern is not None else None
    if call.is_causal:
        pattern = causal() if pattern is None else pattern & causal()
    if pattern is None or L == 0 or S == 0:
        return float(L * S)
    offset = S - L if call.positions and S > L else 0
    if pattern._tile_band() is not None:  # closed form, no tensors: causal, windows
        return float(pattern.tile_pairs(L, S, block_q, block_k, q_offset=offset))
    key = (id(call.pattern), call.is_causal, L, S, block_q, block_k, offset)
    hit = _pairs_cache.get(key)
    if hit is not None:
        return hit[1]
    pairs = float(pattern.tile_pairs(L, S, block_q, block_k, q_offset=offset))
    _pairs_cache[key] = (call.pattern, pairs)  # keeps the pattern alive: ids stay unique
    if len(_pairs_cache) > _MAX_CACHED:
        _pairs_cache.popitem(last=False)
    return pairs


def lse_pass(call: AttentionCall) -> float:
    """Seconds of the ``tiled`` pass that gives a log-sum-exp to a kernel that keeps none."""
    if not call.return_weights:
        return 0.0
    table = cost_constants.CONSTANTS.get(call.device.type) or cost_constants.CONSTANTS["cpu"]
    overhead, per_unit = table["tiled"]["fwd"]
    return overhead + units(call, computed_pairs(call, *TRAITS["tiled"].tile())) * per_unit


def estimate(backend: str, call: AttentionCall, pairs: float) -> Estimate | None:
    """``overhead + units * seconds_per_unit`` from the measured constants, or None if unmeasured."""
    table = cost_constants.CONSTANTS.get(call.device.type) or cost_constants.CONSTANTS["cpu"]
    row = table.get(backend)
    if row is None:
        return None
    overhead, per_unit = row["fwd_bwd" if call.needs_grad else "fwd"]
    seconds = overhead + units(call, pairs) * per_unit
    if call.return_weights:
        seconds += (
            units(call, call.query_shape[-2] * call.key_shape[-2]) * table["weights"]["fwd"][1]
        )
    share = pairs / max(1, call.query_shape[-2] * call.key_shape[-2])
    note = f"~{format_seconds(seconds)} for {share:.0%} of the pairs"
    if call.device.type not in cost_constants.CONSTANTS:
        note += f" (constants measured on cpu, not {call.device.type})"
    return Estimate(seconds, note)


def gather_seconds(call: AttentionCall) -> float:
    """Seconds to copy a paged call's keys/values (``key_shape``) out of the pool.

    The gather path copies every row's ``S`` slots into a batch before a backend
    attends over it; the ``paged`` backend copies each row's stored blocks, group by
    group (:data:`attnlab.backend_traits.PAGED_COST`).
    """
    b, h_kv, s, e = call.key_shape[0], call.key_shape[-3], call.key_shape[-2], call.key_shape[-1]
    nbytes = b * h_kv * s * (e + call.value_shape[-1]) * call.dtype.itemsize
    return PAGED_COST.gather_overhead_s + nbytes / PAGED_COST.gather_bytes_per_s
