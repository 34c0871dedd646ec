"""What each attention backend is and costs: one torch-free record per backend.

The registry (:mod:`attnlab.backends.registry`) builds each :class:`~attnlab.backends.
registry.Backend` from it (name, exactness, what it accepts, priority, description), the
backends take their tile sizes from it, ``auto``'s cost model reads its per-call
constants (:mod:`attnlab.backends.cost_constants`, torch-free too), and the analysis
cost model (:mod:`attnlab.analysis.cost_layers`) reads how a backend spends work and
memory from the same record. A fact about a backend is written here once.

It sits at the package's top level, outside ``backends/`` (whose ``__init__`` imports
every backend, hence torch), so that the analysis tools read it with a torch-free import.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = ["PAGED_COST", "TRAITS", "BackendTraits", "PagedCost"]


@dataclass(frozen=True)
class BackendTraits:
    """How an attention backend works, what it accepts, and how it spends work and memory.

    Attributes:
        name: the name users pass as ``backend=`` ("" for a variant used only by the cost model).
        exact: False for approximations (never chosen by ``auto``).
        accepts_patterns: takes a mask pattern directly (else a dense mask).
        accepts_positions: takes ``q_positions``/``k_positions`` (else a dense mask, or refused).
        priority: breaks ties between equal estimates (lower first).
        description: one line for ``explain`` and reports.
        refuses: what it cannot run, in words (its check gives the reason per call).
        materialises_scores: builds the ``L x S`` score matrix (and saves it for backward).
        skips: which masked work it skips: ``"none"`` (computes every pair),
            ``"causal"`` (only a causal mask, passed as ``is_causal``), ``"pattern"``
            (any structured mask, at tile granularity).
        block: ``(block_q, block_k)`` tile of a tile-skipping kernel (its unit of skipping).
        score_tensors_saved: score-sized tensors saved for the backward pass (training).
        score_tensors_live: score-sized tensors alive at once in an inference forward.
        backward_factor: backward attention matmuls as a multiple of the forward's.
        linear: kernelised linear attention (no score matrix at all; Katharopoulos et al., 2020).
        reads_blocks: takes a paged cache's pools and block tables instead of a batch of
            keys (PagedAttention, Kwon et al., 2023); chosen only for paged calls.
        dropout_score_tensors: score-sized tensors saved when attention dropout is on in
            training (None: as without dropout). torch's fused CPU kernels fall back to
            the math path with dropout, which saves the weights, the dropout mask (float
            on CPU) and the dropped weights.
        transient_score_tensors: score-sized gradients alive at once at the peak of the
            backward of a materialised attention (the reference's composite softmax makes
            about 3; torch's math path about 1).
    """

    name: str = ""
    exact: bool = True
    accepts_patterns: bool = False
    accepts_positions: bool = False
    priority: int = 100
    description: str = ""
    refuses: tuple[str, ...] = ()
    materialises_scores: bool = False
    skips: Literal["none", "causal", "pattern"] = "pattern"
    block: tuple[int, int] | None = None
    score_tensors_saved: float = 0.0
    score_tensors_live: float = 0.0
    backward_factor: float = 2.5
    linear: bool = False
    reads_blocks: bool = False
    dropout_score_tensors: float | None = None
    transient_score_tensors: float = 3.0

    def tile(self) -> tuple[int, int]:
        """``(block_q, block_k)``; raises ``ValueError`` for a backend without tiles."""
        if self.block is None:
            raise ValueError(f"backend {self.name!r} has no tile size")
        return self.block

    def registry_fields(self) -> dict[str, Any]:
        """The fields :class:`~attnlab.backends.call.Backend` takes from this record."""
        d = asdict(self)
        keys: tuple[str, ...] = (
            "name",
            "exact",
            "accepts_patterns",
            "accepts_positions",
            "priority",
        )
        if self.reads_blocks:
            keys += ("reads_blocks",)
        return {k: d[k] for k in keys} | {"description": self.description}


#: The registered backends' traits, by name. ``register_backend_traits`` in the
#: analysis cost model adds others.
TRAITS: dict[str, BackendTraits] = {
    # sdpa_reference saves, per layer: the scaled scores (amax's input), exp(scores)
    # and the normalised weights (matmul's input); all three are alive in a forward too.
    "reference": BackendTraits(
        name="reference",
        accepts_patterns=True,
        accepts_positions=True,
        priority=1000,
        description="the full score matrix in float32/float64; runs every call and returns weights",
        materialises_scores=True,
        skips="none",
        score_tensors_saved=3.0,
        score_tensors_live=3.0,
        backward_factor=2.0,
        dropout_score_tensors=4.0,
    ),
    # torch's CPU flash kernel: saves q, k, v, out and the logsumexp; skips causal tiles.
    "sdpa": BackendTraits(
        name="sdpa",
        priority=10,
        description="torch's fused kernel (flash/memory-efficient/math, as torch picks)",
        refuses=("score modifiers",),
        skips="causal",
        dropout_score_tensors=3.0,
        transient_score_tensors=1.0,
    ),
    "flex": BackendTraits(
        name="flex",
        accepts_patterns=True,
        priority=20,
        description="torch's FlexAttention, compiled, with the pattern's block mask",
        refuses=("dropout", "dense masks", "positions", "float64", "gradients on CPU"),
        block=(128, 128),
    ),
    "tiled": BackendTraits(
        name="tiled",
        accepts_patterns=True,
        accepts_positions=True,
        priority=30,
        description="FlashAttention-2 tiles with an online softmax; skips masked-out tiles",
        refuses=("dropout", "gradients to a float mask"),
        block=(256, 256),
    ),
    "sparse": BackendTraits(
        name="sparse",
        accepts_patterns=True,
        accepts_positions=True,
        priority=40,
        description=(
            "computes only the key blocks a pattern needs (a band of blocks in place, "
            "else gathered): time and memory ~ L*w"
        ),
        refuses=("dropout", "dense masks"),
        block=(64, 64),
    ),
    "linear": BackendTraits(
        name="linear",
        exact=False,
        accepts_patterns=True,
        priority=90,
        description="kernelised linear attention (elu+1 features), an approximation; by name only",
        refuses=("score modifiers", "positions", "masks other than causal and key padding"),
        skips="none",
        backward_factor=2.0,
        linear=True,
    ),
}
# PagedAttention's block-table path (backends/paged.py): one fused
# kernel call per group of rows of equal length over the blocks those rows hold.
TRAITS["paged"] = BackendTraits(
    name="paged",
    accepts_patterns=True,
    accepts_positions=True,
    reads_blocks=True,
    priority=15,
    description="reads each row's keys/values through its block table (PagedAttention)",
    refuses=("contiguous keys", "dropout", "weights", "dense masks"),
    skips="causal",
)

# The same read done by a C++ kernel in place (backends/paged_kernel.py, backends/native.py).
TRAITS["paged_kernel"] = BackendTraits(
    name="paged_kernel",
    accepts_patterns=True,
    accepts_positions=True,
    reads_blocks=True,
    priority=12,
    description="reads each row's keys/values in place through its block table (C++ kernel)",
    refuses=(
        "contiguous keys",
        "dropout",
        "weights",
        "gradients",
        "score modifiers",
        "patterns other than causal and sliding windows",
        "dtypes other than float32",
        "devices other than the CPU",
    ),
    skips="causal",
)


@dataclass(frozen=True)
class PagedCost:
    """Measured constants of a paged step's key/value reads (CPU, float32).

    Attributes:
        gather_overhead_s: fixed cost of one gather of a step's keys/values from the pool.
        gather_bytes_per_s: bytes per second an ``index_select`` of pool slots copies.
        call_overhead_s: fixed cost of the ``paged`` backend's own work per call (the
            keys' slots and the mask from the block table, host side).
    """

    gather_overhead_s: float
    gather_bytes_per_s: float
    call_overhead_s: float


#: From ``python benchmarks/paged_attention.py`` (docs/benchmarks.md): an ``index_select``
#: of pool slots copied 16 MiB in about 4 ms on one thread of the quiet machine (a ``sum``
#: read 5.5 GB/s under load), and the ``paged`` backend's own host work is about 0.2 ms.
PAGED_COST = PagedCost(gather_overhead_s=3e-5, gather_bytes_per_s=4e9, call_overhead_s=2e-4)
