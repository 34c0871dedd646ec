"""Float linears at a few rows (decode steps): weights laid out once, the kernel chosen by measurement.

A decode step multiplies a handful of rows (1 to 32: one token per sequence) by every
weight of the model, so it is bound by reading the weights, and how the GEMM reads them
decides its speed. ``F.linear(x, W)`` hands MKL a transposed ``W`` ``[N, K]``; at 8 rows
MKL's GEMM was measured 2-3x slower that way than the same product with other layouts of
the same weights (SmolLM2's ``[49152, 576]`` head: 29 ms against 12 ms, one thread). Like
inductor's freezing pass (``torch/_inductor/fx_passes/mkldnn_fusion.py``) and vLLM's CPU
linears (``dispatch_cpu_unquantized_gemm``, which prepacks for oneDNN), this module lays
the weight out once and multiplies it with one of these kernels:

- ``"linear"``: ``F.linear(x, W)`` on the weight as it is (no copy).
- ``"mm_t"``: ``x @ Wt`` with ``Wt [K, N]`` stored contiguous (one copy, any rows).
- ``"mkl"``: MKL's packed GEMM, ``torch.ops.mkl._mkl_reorder_linear_weight`` +
  ``_mkl_linear`` (what inductor's freezing emits for float32). A pack serves exactly the
  row count it was packed for (other counts fall back to ``F.linear`` inside the op), so it
  is one copy per row bucket and is offered only where the rows equal the bucket.
- ``"mkldnn"``: oneDNN's prepacked inner product, ``torch.ops.mkldnn._reorder_linear_weight``
  + ``_linear_pointwise`` (one blocked copy, any rows).

vLLM's own oneDNN handle (``torch.ops._C.onednn_mm``) is an extension built with vLLM, not
reachable from plain torch; ``"mkldnn"`` is the same library's prepacked path.

Every kernel sums in float32 (or bfloat16 with float32 accumulation), so they agree up to
float32 rounding. :func:`choose_gemm` times the runnable kernels once per (shape, bias,
dtype, row bucket, threads) over copies of a random weight of that shape that exceed the
L2 cache (the weights of a decode step come from L3 or memory, never from L1/L2), keeps the
fastest, and remembers it (:class:`GemmChoice`, ``str()`` says which and why). Rows past
:data:`MAX_ROWS` are GEMM-shaped (a prompt) and run ``"linear"`` by rule.

Small shapes' kernels often differ by less than the noise, so the rounds interleave
(order rotated), each kernel keeps its best, and a kernel replaces the default
``"linear"`` (or a simpler one, earlier in :data:`GEMM_KERNELS`) only when more than
:data:`MARGIN` faster. Inside :func:`~attnlab.backends.gemm_cache.persisted_choices`
(``attnlab serve``/``generate``) a decision is written to a file and read back by later
processes, so every start of a server on one machine lays its linears out alike.

The packed kernels are torch custom ops (``attnlab_gemm::mkl_linear``,
``attnlab_gemm::mkldnn_linear``) with fake kernels, so a compiled step calls them without
a graph break (inductor cannot lower the MKL/oneDNN ops on tensors that are graph inputs).

:class:`PackedLinear` is for inference only: a call that needs gradients (grad mode on and
the weight or input requiring grad) raises, because the laid-out copies do not follow the
weight through an optimizer step; an eager call notices a weight changed in place (its
version counter) and lays it out again. A compiled graph keeps the copies it was traced with.

Shape notation: ``M`` rows, ``K`` input features, ``N`` output features.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import Tensor

from attnlab.backends.gemm_cache import active_choice_file, machine_key
from attnlab.backends.gemm_kernels import GEMM_KERNELS, gemm_unavailable, prepare_gemm, run_gemm

__all__ = [
    "GEMM_KERNELS",
    "MARGIN",
    "MAX_ROWS",
    "GemmChoice",
    "PackedLinear",
    "choose_gemm",
    "clear_gemm_memo",
    "gemm_unavailable",
    "pack_linear",
    "pick",
    "row_bucket",
    "static_rows",
    "use_gemm",
]

log = logging.getLogger(__name__)

#: the largest row bucket measured; more rows run ``"linear"``
MAX_ROWS = 32
#: bytes of weight copies a measurement cycles through (beyond the L2 cache)
_MEASURE_BYTES = 32 << 20
_MAX_COPIES = 8
#: interleaved timing rounds per measurement (each kernel keeps its best)
_ROUNDS = 7
#: how much faster than the default (or a simpler kernel) a kernel must be to be chosen
MARGIN = 0.10
_DTYPES = (torch.float32, torch.bfloat16)


# ----------------------------------------------------------------------------- choice


@dataclass(frozen=True)
class GemmChoice:
    """Which kernel multiplies one shape at one row bucket, and why.

    Attributes:
        chosen: the kernel for exactly ``rows`` rows.
        other_rows: the kernel for fewer rows of the same bucket (``"mkl"``'s pack serves
            only its own row count, so the best of the others).
        how: ``"measured"``, ``"forced"`` (:func:`use_gemm` or a named kernel) or
            ``"rule"`` (more than :data:`MAX_ROWS` rows, or no measurement inside a graph).
        rows: the row bucket (a power of two up to :data:`MAX_ROWS`).
        threads: torch's intra-op threads when it was measured.
        timings_us: each runnable kernel's best time, microseconds.
        rejected: kernels that cannot run, with the reason.
        stored: the decision was read from a choice file (measured by an earlier
            process: :mod:`attnlab.backends.gemm_cache`), not measured now.
    """

    chosen: str
    other_rows: str
    how: str
    rows: int
    threads: int
    timings_us: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    stored: bool = False

    def __str__(self) -> str:
        times = ", ".join(f"{k} {v:.0f} us" for k, v in self.timings_us.items())
        why = f" ({times}{', stored' if self.stored else ''})" if times else ""
        other = f"; fewer rows: {self.other_rows}" if self.other_rows != self.chosen else ""
        return (
            f"{self.chosen} [{self.how}{why}] at {self.rows} rows, {self.threads} thread(s){other}"
        )


_MEMO: dict[tuple[object, ...], GemmChoice] = {}
_FORCED: ContextVar[str | None] = ContextVar("attnlab_gemm_kernel", default=None)


def clear_gemm_memo() -> None:
    """Forget every measured choice (the next call measures again) and the samples."""
    _MEMO.clear()
    _SAMPLES.clear()


@contextlib.contextmanager
def use_gemm(name: str) -> Iterator[None]:
    """Make :func:`choose_gemm` (and so :class:`PackedLinear` packed inside the block)
    pick kernel ``name``.

    Raises:
        ValueError: an unknown kernel name.
    """
    gemm_unavailable(name, torch.float32)  # validates the name
    token = _FORCED.set(name)
    try:
        yield
    finally:
        _FORCED.reset(token)


#: whether graphs traced now have static row counts (:func:`static_rows`)
_STATIC_ROWS = [False]


@contextlib.contextmanager
def static_rows() -> Iterator[None]:
    """Graphs traced (and run) inside the block have static row counts (a decode step
    compiled per batch size), so :class:`PackedLinear` picks its packed kernels in them.

    Elsewhere a compiled graph calls ``F.linear``: with dynamic shapes the row count is
    symbolic, and branching on it would guard the graph to one range of counts. Dynamo
    guards on this flag, so a graph traced inside runs inside, and one traced outside runs
    outside, each without recompiling.
    """
    before = _STATIC_ROWS[0]
    _STATIC_ROWS[0] = True
    try:
        yield
    finally:
        _STATIC_ROWS[0] = before


def row_bucket(rows: int) -> int:
    """``rows`` rounded up to a power of two (one measurement per bucket)."""
    b = 1
    while b < rows:
        b *= 2
    return b


def _time(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Each function's best time over interleaved rounds (the order rotated each round,
    so no function always runs after the same one), microseconds."""
    for fn in fns.values():
        fn()  # warm-up
    names = list(fns)
    best = dict.fromkeys(fns, float("inf"))
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            fns[name]()
            best[name] = min(best[name], time.perf_counter() - t0)
    return {k: v * 1e6 for k, v in best.items()}


def pick(timings: dict[str, float], margin: float = MARGIN) -> str:
    """The first kernel of :data:`GEMM_KERNELS` (``"linear"``, the default, first) whose
    time is within ``margin`` of the fastest: a kernel wins only by more than the noise."""
    best = min(timings.values())
    return next(n for n in GEMM_KERNELS if n in timings and timings[n] <= best * (1 + margin))


#: the last shape's random weights and their layouts, reused across its row buckets
_SAMPLES: dict[
    tuple[object, ...], tuple[list[Tensor], dict[tuple[str, int], list[Tensor | None]]]
] = {}


def _samples(
    n: int, k: int, dtype: torch.dtype
) -> tuple[list[Tensor], dict[tuple[str, int], list[Tensor | None]]]:
    """Copies of a random ``[n, k]`` weight that together exceed the L2 cache (at most
    :data:`_MAX_COPIES`), and a cache of their layouts; kept for one shape at a time."""
    key = (n, k, dtype)
    if key not in _SAMPLES:
        _SAMPLES.clear()
        size = n * k * torch.finfo(dtype).bits // 8
        copies = min(_MAX_COPIES, max(1, _MEASURE_BYTES // size))
        gen = torch.Generator().manual_seed(0)
        ws = [(torch.randn(n, k, generator=gen) / k**0.5).to(dtype) for _ in range(copies)]
        _SAMPLES[key] = (ws, {})
    return _SAMPLES[key]


def _measure(
    n: int, k: int, rows: int, dtype: torch.dtype, bias: bool, names: Sequence[str]
) -> dict[str, float]:
    """Time ``names`` on ``rows`` rows over :func:`_samples`; per-copy microseconds."""
    ws, layouts = _samples(n, k, dtype)
    b = torch.zeros(n, dtype=dtype) if bias else None
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    forms = {}
    for name in names:
        key = (name, rows if name == "mkl" else 0)
        if key not in layouts:
            layouts[key] = [prepare_gemm(name, w, rows) for w in ws]
        forms[name] = layouts[key]

    def loop(name: str) -> Callable[[], None]:
        def run() -> None:
            for w, f in zip(ws, forms[name]):
                run_gemm(name, x, w, b, f, rows)

        return run

    with torch.no_grad():
        t = _time({name: loop(name) for name in names}, rounds=_ROUNDS)
    return {name: v / len(ws) for name, v in t.items()}


def choose_gemm(
    out_features: int,
    in_features: int,
    rows: int,
    dtype: torch.dtype = torch.float32,
    *,
    bias: bool = False,
    kernel: str = "auto",
) -> GemmChoice:
    """The kernel for ``rows`` rows times a ``[out_features, in_features]`` weight.

    Args:
        out_features: ``N``.
        in_features: ``K``.
        rows: ``M`` (bucketed to a power of two; past :data:`MAX_ROWS`, ``"linear"``).
        dtype: the weight's dtype (float32 or bfloat16).
        bias: whether the layer adds a bias.
        kernel: ``"auto"`` (measured once, memoised) or a kernel name.

    Raises:
        ValueError: an unknown or unavailable kernel name, or an unsupported dtype.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype}")
    threads = torch.get_num_threads()
    rejected = {n: why for n in GEMM_KERNELS if (why := gemm_unavailable(n, dtype))}
    forced = kernel if kernel != "auto" else _FORCED.get()
    bucket = row_bucket(rows)
    if forced is not None:
        if forced in rejected or forced not in GEMM_KERNELS:
            why = rejected.get(forced, f"expected 'auto' or one of {GEMM_KERNELS}")
            raise ValueError(f"kernel {forced!r} cannot run: {why}")
        other = "linear" if forced == "mkl" else forced
        return GemmChoice(forced, other, "forced", bucket, threads, rejected=rejected)
    if bucket > MAX_ROWS:
        return GemmChoice("linear", "linear", "rule", bucket, threads, rejected=rejected)
    key = (out_features, in_features, bias, dtype, bucket, threads)
    memo = _MEMO.get(key)
    if memo is not None:
        return memo
    names = [n for n in GEMM_KERNELS if n not in rejected]
    file = active_choice_file()
    machine = machine_key(threads) if file is not None else ""
    skey = f"{out_features},{in_features},{int(bias)},{str(dtype).removeprefix('torch.')},{bucket}"
    stored = file.get(machine, skey, names) if file is not None else None
    if stored is not None:
        chosen, other, t = stored
        _MEMO[key] = GemmChoice(chosen, other, "measured", bucket, threads, t, rejected, True)
        return _MEMO[key]
    timings = _measure(out_features, in_features, bucket, dtype, bias, names)
    best = pick(timings)
    other = pick({n: t for n, t in timings.items() if n != "mkl"})
    choice = GemmChoice(best, other, "measured", bucket, threads, timings, rejected)
    _MEMO[key] = choice
    log.info("float GEMM [%d, %d] x %d rows: %s", out_features, in_features, bucket, choice)
    if file is not None:
        file.put(machine, skey, {"chosen": best, "other_rows": other, "timings_us": timings})
    return choice


# ----------------------------------------------------------------------------- the layer


class PackedLinear:
    """``F.linear(x, weight, bias)`` through laid-out copies of ``weight``, for inference.

    Built by :func:`pack_linear`. Holds a reference to ``weight`` (never a copy of the
    parameter itself, so tied weights stay tied) and, per kernel chosen for some row
    bucket, its laid-out copy. A call with ``M`` rows runs the kernel chosen for the
    smallest packed bucket of at least ``M`` rows (``"mkl"`` only at exactly the
    bucket's rows, else the bucket's best other kernel), and ``"linear"`` past the largest
    packed bucket (so pack for the rows you run). Inside a compiled graph the packed
    kernels run only under :func:`static_rows`. :attr:`last` is the last eager call's
    choice (None: ``"linear"`` by rule).
    """

    def __init__(
        self,
        weight: Tensor,
        bias: Tensor | None = None,
        *,
        rows: Sequence[int] = (1, 2, 4, 8, 16, 32),
        kernel: str = "auto",
    ) -> None:
        _check_weight(weight, bias)
        self.weight, self.bias, self.kernel = weight, bias, kernel
        self.out_features, self.in_features = weight.shape
        self.rows = tuple(sorted({row_bucket(_check_rows(r)) for r in rows}))
        self.choices: dict[int, GemmChoice] = {}
        self.forms: dict[tuple[str, int], Tensor] = {}
        self.last: GemmChoice | None = None
        self._pack()

    def _pack(self) -> None:
        """Choose per row bucket, lay out the copies the choices read, and fix the kernel
        of every row count up to :data:`MAX_ROWS` (new objects: a compiled graph's guards
        see a change only when the weight changed; calls never modify them)."""
        self._stamp = self._weight_stamp()
        choices = {b: self.choice(b) for b in self.rows}
        forms: dict[tuple[str, int], Tensor] = {}
        for b, c in choices.items():
            for name in {c.chosen, c.other_rows} - {"linear"}:
                key = (name, b if name == "mkl" else 0)
                if key not in forms:
                    form = prepare_gemm(name, self.weight, b)
                    assert form is not None
                    forms[key] = form
        # rows m: its bucket's kernel (mkl only at exactly the bucket's rows); a bucket not
        # packed: the next packed bucket's any-rows kernel; past them all: F.linear
        plan: list[tuple[str, int, GemmChoice | None]] = [("linear", 0, None)]
        for m in range(1, MAX_ROWS + 1):
            above = [r for r in self.rows if r >= m]
            if not above:
                plan.append(("linear", 0, None))
                continue
            c = choices[above[0]]
            b = above[0]
            name = c.chosen if m == b else c.other_rows
            plan.append((name, b if name == "mkl" else 0, c))
        self.choices, self.forms, self._plan = choices, forms, tuple(plan)

    def _weight_stamp(self) -> tuple[object, ...]:
        """What changes when the weight is written in place, replaced or converted, or
        the thread count changes (eager calls lay the copies out again then)."""
        w = self.weight
        return (w._version, w.data_ptr(), w.dtype, torch.get_num_threads())

    def choice(self, rows: int) -> GemmChoice:
        """The decision for ``rows`` rows' bucket (measuring now if it was not yet)."""
        return choose_gemm(
            self.out_features,
            self.in_features,
            row_bucket(rows),
            self.weight.dtype,
            bias=self.bias is not None,
            kernel=self.kernel,
        )

    @property
    def extra_bytes(self) -> int:
        """About the bytes held by the laid-out copies beyond the weight (one weight's
        worth each; an MKL pack reserves more address space than it touches)."""
        return sum(self.weight.numel() * self.weight.element_size() for _ in self.forms)

    def explain(self) -> dict[int, str]:
        """Each packed row bucket's decision, as text."""
        return {b: str(c) for b, c in sorted(self.choices.items())}

    def __call__(self, x: Tensor) -> Tensor:
        """``x [..., K] -> [..., N]``.

        Raises:
            ValueError: gradients are needed (training), or ``x`` has another width,
                dtype or device than the weight.
        """
        w = self.weight
        if torch.is_grad_enabled() and (w.requires_grad or x.requires_grad):
            raise ValueError(
                "PackedLinear is for inference: this call needs gradients (grad mode is on "
                f"and weight.requires_grad={w.requires_grad}, x.requires_grad="
                f"{x.requires_grad}); run it under torch.no_grad()/torch.inference_mode(), or "
                "unpack the model (attnlab.models.inference.unpack_model) to train"
            )
        if x.shape[-1] != self.in_features or x.dtype != w.dtype or x.device != w.device:
            raise ValueError(
                f"x must be [..., {self.in_features}] {w.dtype} on {w.device}, got "
                f"{tuple(x.shape)} {x.dtype} on {x.device}"
            )
        compiling = torch.compiler.is_compiling()
        if not compiling and self._weight_stamp() != self._stamp:
            log.info("weight [%d, %d] changed (or the thread count): laid out again",
                     self.out_features, self.in_features)  # fmt: skip
            self._pack()
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        m = x2.shape[0]
        name, pack_rows, c = "linear", 0, None
        # inside a graph only where the caller declared the rows static (a dynamic graph's
        # symbolic rows would be guarded on, and the graph recompiled per count)
        if (not compiling or _STATIC_ROWS[0]) and m <= MAX_ROWS:
            name, pack_rows, c = self._plan[int(m)]
        if not compiling:
            self.last = c
        form = self.forms.get((name, pack_rows))
        y = run_gemm(name, x2.contiguous(), w, self.bias, form, pack_rows)
        return y.reshape(*x.shape[:-1], self.out_features)


def _check_rows(r: object) -> int:
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"rows must be positive ints, got {r!r}")
    return r


def _check_weight(weight: object, bias: object) -> None:
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ValueError(
            f"weight must be a 2-D tensor [out_features, in_features], got "
            f"{getattr(weight, 'shape', type(weight).__name__)}"
        )
    if weight.dtype not in _DTYPES:
        raise ValueError(f"weight must be float32 or bfloat16, got {weight.dtype}")
    if weight.device.type != "cpu":
        raise ValueError(f"weight must be on the CPU (MKL/oneDNN layouts), got {weight.device}")
    if weight.is_meta or weight.layout != torch.strided:
        raise ValueError(f"weight must be a dense strided tensor, got layout {weight.layout}")
    if bias is not None and (
        not isinstance(bias, Tensor)
        or bias.shape != (weight.shape[0],)
        or bias.dtype != weight.dtype
        or bias.device != weight.device
    ):
        raise ValueError(
            f"bias must be None or a [{weight.shape[0]}] {weight.dtype} tensor beside the "
            f"weight, got {getattr(bias, 'shape', type(bias).__name__)}"
        )


def pack_linear(
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    rows: Sequence[int] = (1, 2, 4, 8, 16, 32),
    kernel: str = "auto",
) -> PackedLinear:
    """Lay out ``weight`` for the row counts ``rows`` (choosing each bucket's kernel by
    measurement, memoised per shape) and return a callable equal to
    ``F.linear(x, weight, bias)`` within float32 rounding.

    Args:
        weight: ``[N, K]`` float32 or bfloat16, on the CPU.
        bias: ``[N]`` or None.
        rows: the row counts the caller will run (a decode step's batch sizes).
        kernel: ``"auto"`` or one of :data:`GEMM_KERNELS`.

    Raises:
        ValueError: ``weight``/``bias``/``rows`` of another kind (named), or a kernel that
            cannot run.
    """
    return PackedLinear(weight, bias, rows=rows, kernel=kernel)
