"""Kernels for weight-only quantized matmuls, and an ``auto`` that picks one by measurement.

A quantized linear layer (:mod:`attnlab.modules.quant_linear`) hands its weights to one
of these kernels:

- ``"int8pack"``: torch's ``_weight_int8pack_mm`` (int8 weights, one scale per output
  channel, activations in the compute dtype).
- ``"int8groups"``: the same kernel once per group of input features (grouped int8,
  GGUF's Q8_0), the partial products summed.
- ``"int4pack"``: torch's ``_weight_int4pack_mm_for_cpu`` over the weights repacked once
  by ``_convert_weight_to_int4pack_for_cpu`` (4-bit groups of 32/64/128/256 with a scale
  and a zero point; ``N`` a multiple of 16).
- ``"fused"``: attnlab's own CPU kernel (:mod:`attnlab.backends.qmatmul_cpu`): the blocks
  expanded in registers and multiplied in float32, for int8 and int4 in groups of any
  multiple of 32 (the GEMV shape of decoding; Q8_0 in one pass instead of a call per group).
- ``"dequant"``: expand the weights to the compute dtype and call ``F.linear`` (any
  layout; the choice for long prompts, where one GEMM beats the GEMV-shaped kernels).

With ``compute="int8"`` the activations are quantized to int8 blocks of 32 first, as
llama.cpp does for quantized weights (its Q8_0/Q8_1 activation blocks: ``d = amax / 127``
in float16, levels rounded half to even), and only these kernels run, which compute
the same numbers up to float32 rounding:

- ``"q8tile"``: attnlab's C++ kernel over weights interleaved once in tiles of 16 output
  features (:func:`attnlab.backends.qmatmul_cpu.qgemv_q8t`, AVX-512 VNNI builds only): one
  ``vpdpbusd`` per 4 levels of 16 features, rows in fours; decode and prefill.
- ``"q8dot"``: attnlab's C++ kernel (:func:`attnlab.backends.qmatmul_cpu.qgemv_q8`): exact
  int8 dot products per block (AVX-512 VNNI or AVX2), scaled in float32 (a few rows), over
  the weights' rows as stored.
- ``"q8dequant"``: the activation blocks rounded in torch and multiplied by the expanded
  weights with ``F.linear`` (the choice for long prompts).

The compute dtype is decided first and never by timing, so the choice of kernel changes
speed, not meaning: ``compute="auto"`` runs bfloat16 activations where the CPU multiplies
bfloat16 natively (AVX-512 BF16 or AMX, what ``torch.ops.mkldnn._is_mkldnn_bf16_supported``
reports) and the input's dtype elsewhere (on an AVX2-only CPU a bfloat16 matmul was
measured 10x slower than float32). Among the kernels that can run a shape, ``auto`` times
each once per (layout, shape, row bucket, dtype) and keeps the fastest, as
:func:`explain_linear` reports; ``with use_kernel(name):`` forces one.

Shape notation: ``M`` rows of activations, ``K`` input features, ``N`` output features.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from attnlab.backends.precision import native_bf16

__all__ = [
    "KERNELS",
    "LinearChoice",
    "QuantWeights",
    "choose_kernel",
    "compute_dtype",
    "explain_linear",
    "native_bf16",
    "run_kernel",
    "use_kernel",
]

COMPUTE_POLICIES = ("auto", "float32", "bfloat16", "input", "int8")
_NAMED = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_INT4_GROUPS = (32, 64, 128, 256)


class QuantWeights(Protocol):
    """What a kernel reads from a quantized layer."""

    kind: str  # "int8" or "int4"
    in_features: int
    out_features: int
    group_size: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor: ...

    def kernel_form(self, name: str, dtype: torch.dtype) -> tuple[Tensor, ...]: ...


def compute_dtype(x_dtype: torch.dtype, policy: str) -> tuple[torch.dtype, str]:
    """The dtype a quantized matmul computes in under ``policy``, and why.

    Raises:
        ValueError: an unknown policy.
    """
    if policy not in COMPUTE_POLICIES:
        raise ValueError(f"compute must be one of {list(COMPUTE_POLICIES)}, got {policy!r}")
    if policy in _NAMED:
        return _NAMED[policy], f"compute={policy!r} was asked for"
    if policy == "int8":
        return torch.float32, (
            "compute='int8' was asked for: activations quantized to int8 blocks of 32 "
            "(llama.cpp's Q8_0/Q8_1), int8 dot products scaled in float32"
        )
    if policy == "input" or x_dtype not in (torch.float32, torch.bfloat16):
        return x_dtype, f"the activations' dtype ({x_dtype})"
    if native_bf16():
        return torch.bfloat16, "this CPU has native bfloat16 matmul (AVX-512 BF16/AMX)"
    return x_dtype, f"no native bfloat16 matmul on this CPU: {x_dtype} activations"


# ----------------------------------------------------------------------------- kernels


def _check_int8pack(w: QuantWeights, dtype: torch.dtype) -> str | None:
    if w.kind != "int8":
        return f"needs int8 weights, these are {w.kind}"
    if w.group_size != w.in_features:
        return f"needs one scale per output channel, these have groups of {w.group_size}"
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"computes in float32/bfloat16/float16, not {dtype}"
    return None


def _run_int8pack(w: QuantWeights, x2: Tensor) -> Tensor:
    q, scales = w.kernel_form("int8pack", x2.dtype)
    return torch._weight_int8pack_mm(x2, q, scales)


def _check_int8groups(w: QuantWeights, dtype: torch.dtype) -> str | None:
    if w.kind != "int8":
        return f"needs int8 weights, these are {w.kind}"
    if w.group_size == w.in_features:
        return "the weights have one scale per channel: int8pack runs them in one call"
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"computes in float32/bfloat16/float16, not {dtype}"
    return None


def _run_int8groups(w: QuantWeights, x2: Tensor) -> Tensor:
    form = w.kernel_form("int8groups", x2.dtype)  # q_0, s_0, q_1, s_1, ...
    g = w.group_size
    y = torch._weight_int8pack_mm(x2[:, :g].contiguous(), form[0], form[1])
    for i in range(1, len(form) // 2):
        xg = x2[:, i * g : (i + 1) * g].contiguous()
        y = y + torch._weight_int8pack_mm(xg, form[2 * i], form[2 * i + 1])
    return y


def _check_int4pack(w: QuantWeights, dtype: torch.dtype) -> str | None:
    if w.kind != "int4":
        return f"needs int4 weights, these are {w.kind}"
    if w.group_size not in _INT4_GROUPS:
        return f"needs groups of {list(_INT4_GROUPS)}, these have {w.group_size}"
    if w.out_features % 16 or w.in_features % 32:
        return (
            f"needs out_features divisible by 16 and in_features by 32, got "
            f"{w.out_features} x {w.in_features}"
        )
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"computes in float32/bfloat16/float16, not {dtype}"
    return None


def _run_int4pack(w: QuantWeights, x2: Tensor) -> Tensor:
    packed, scales_zeros = w.kernel_form("int4pack", x2.dtype)
    return torch._weight_int4pack_mm_for_cpu(x2, packed, w.group_size, scales_zeros)


def _group_refusal(w: QuantWeights) -> str | None:
    """Why the block kernels (``fused``, ``q8dot``, ``q8tile``, ``q8dequant``) cannot read
    ``w``'s groups, or None: they walk blocks of 32 input features."""
    if w.group_size % 32 or w.in_features % w.group_size:
        return f"needs groups of a multiple of 32 features, these have {w.group_size}"
    return None


def _block_form(w: QuantWeights, name: str) -> tuple[Tensor, Tensor, Tensor | None]:
    """Kernel form ``name`` (``"fused"`` rows or ``"tiled"``) as ``(levels, scales, mins)``,
    ``mins`` None for int8 weights."""
    form = w.kernel_form(name, torch.float32)  # (levels, scales) or (levels, scales, mins)
    return form[0], form[1], form[2] if len(form) == 3 else None


def _check_fused(w: QuantWeights, dtype: torch.dtype) -> str | None:
    from attnlab.backends.qmatmul_cpu import unavailable

    if (why := _group_refusal(w)) is not None:
        return why
    if dtype not in (torch.float32, torch.bfloat16):
        return f"computes in float32 (from float32/bfloat16 activations), not {dtype}"
    return unavailable()


def _run_fused(w: QuantWeights, x2: Tensor) -> Tensor:
    from attnlab.backends.qmatmul_cpu import qgemv

    q, s, m = _block_form(w, "fused")
    return qgemv(x2.to(torch.float32).contiguous(), q, s, m, w.group_size).to(x2.dtype)


def _check_q8dot(w: QuantWeights, dtype: torch.dtype) -> str | None:
    from attnlab.backends.qmatmul_cpu import unavailable

    return _group_refusal(w) or unavailable()


def _run_q8dot(w: QuantWeights, x2: Tensor) -> Tensor:
    from attnlab.backends.qmatmul_cpu import qgemv_q8

    q, s, m = _block_form(w, "fused")  # the same levels as the float kernel
    return qgemv_q8(x2.to(torch.float32).contiguous(), q, s, m, w.group_size)


def _check_q8tile(w: QuantWeights, dtype: torch.dtype) -> str | None:
    from attnlab.backends.qmatmul_cpu import tiled_unavailable

    return _group_refusal(w) or tiled_unavailable()


def _run_q8tile(w: QuantWeights, x2: Tensor) -> Tensor:
    from attnlab.backends.qmatmul_cpu import qgemv_q8t

    q, s, m = _block_form(w, "tiled")
    return qgemv_q8t(x2.to(torch.float32).contiguous(), q, s, m, w.out_features)


def _check_q8dequant(w: QuantWeights, dtype: torch.dtype) -> str | None:
    return _group_refusal(w)


def _run_q8dequant(w: QuantWeights, x2: Tensor) -> Tensor:
    from attnlab.functional.quant import quantize_act_q8

    m, k = x2.shape
    q, d, sx = quantize_act_q8(x2.to(torch.float32))  # [M, K/32, 32], [M, K/32, 1] x2
    xq = (q * d).reshape(m, k)
    y = torch.nn.functional.linear(xq, w.dequantize(torch.float32))  # [M, N]
    if w.kind == "int4":  # the minimums' term with Q8_1's float16 block sums, as llama.cpp
        mins: Tensor = w.mins  # type: ignore[attr-defined]
        per = w.group_size // 32
        exact = sx.reshape(m, -1, per).sum(-1)  # [M, K/G]
        used = (q * d).reshape(m, -1, per * 32).sum(-1)  # what F.linear multiplied by m
        y = y + (exact - used) @ mins.t()
    return y


def _check_dequant(w: QuantWeights, dtype: torch.dtype) -> str | None:
    return None


def _run_dequant(w: QuantWeights, x2: Tensor) -> Tensor:
    return torch.nn.functional.linear(x2, w.dequantize(x2.dtype))


@dataclass(frozen=True)
class Kernel:
    """One way to multiply by quantized weights: ``check`` says why it cannot (or None)."""

    name: str
    check: Callable[[QuantWeights, torch.dtype], str | None]
    run: Callable[[QuantWeights, Tensor], Tensor]
    activations: str = "float"  # "int8": runs only (and always) under compute="int8"


KERNELS: dict[str, Kernel] = {
    k.name: k
    for k in (
        Kernel("int8pack", _check_int8pack, _run_int8pack),
        Kernel("int8groups", _check_int8groups, _run_int8groups),
        Kernel("int4pack", _check_int4pack, _run_int4pack),
        Kernel("fused", _check_fused, _run_fused),
        Kernel("dequant", _check_dequant, _run_dequant),
        Kernel("q8tile", _check_q8tile, _run_q8tile, "int8"),
        Kernel("q8dot", _check_q8dot, _run_q8dot, "int8"),
        Kernel("q8dequant", _check_q8dequant, _run_q8dequant, "int8"),
    )
}

_FORCED: ContextVar[str | None] = ContextVar("attnlab_qmatmul_kernel", default=None)


@contextlib.contextmanager
def use_kernel(name: str) -> Iterator[None]:
    """Make ``auto`` resolve to kernel ``name`` inside the block.

    Raises:
        ValueError: an unknown kernel name.
    """
    if name not in KERNELS:
        raise ValueError(
            f"unknown quantized-matmul kernel {name!r}; expected one of {list(KERNELS)}"
        )
    token = _FORCED.set(name)
    try:
        yield
    finally:
        _FORCED.reset(token)


# ----------------------------------------------------------------------------- auto


@dataclass(frozen=True)
class LinearChoice:
    """Why one kernel runs a quantized matmul of one shape.

    Attributes:
        chosen: the kernel's name.
        compute_dtype: the dtype the activations are multiplied in.
        dtype_reason: why that dtype.
        how: ``"measured"``, ``"forced"`` (a name or :func:`use_kernel`), or ``"rule"``
            (inside a compiled graph with no measurement yet: the packed kernel for a few
            rows, ``dequant`` for many).
        timings_us: each runnable kernel's measured time for ``rows`` rows, microseconds.
        rejected: each kernel that cannot run, with the reason.
        rows: the row bucket measured (a power of two).
        activations: ``"float"``, or ``"int8"`` (quantized to blocks of 32 first).
    """

    chosen: str
    compute_dtype: torch.dtype
    dtype_reason: str
    how: str
    timings_us: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    rows: int = 1
    activations: str = "float"

    def __str__(self) -> str:
        times = ", ".join(f"{k} {v:.0f} us" for k, v in self.timings_us.items())
        why = f" ({times})" if times else ""
        act = " with int8 activations" if self.activations == "int8" else ""
        return f"{self.chosen} [{self.how}{why}] in {self.compute_dtype}{act}: {self.dtype_reason}"


_MEMO: dict[tuple[object, ...], LinearChoice] = {}


def _bucket(rows: int) -> int:
    """Rows rounded up to a power of two, at most 512: one measurement per bucket."""
    b = 1
    while b < rows and b < 512:
        b *= 2
    return b


def _time_all(fns: dict[str, Callable[[], Tensor]], rounds: int = 5) -> dict[str, float]:
    """Each function's best time over ``rounds`` interleaved rounds, microseconds: a
    neighbour's burst of load then slows every candidate of a round, not one of them."""
    slowest = 0.0
    for fn in fns.values():
        t0 = time.perf_counter()
        fn()  # warm-up: builds the kernel's packed form
        slowest = max(slowest, time.perf_counter() - t0)
    if slowest > 0.05:  # a long prompt's shape: one round is signal enough, and cheaper
        rounds = 1
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            if rounds > 1:  # its own data back in cache first: the previous candidate's
                fn()  # (dequant writes the whole float matrix) must not count against it
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return {k: v * 1e6 for k, v in best.items()}


def _reject(k: Kernel, w: QuantWeights, dtype: torch.dtype, act: str) -> str | None:
    """Why kernel ``k`` cannot run ``w`` with ``act`` activations in ``dtype``, or None."""
    if k.activations != act:
        return (
            "multiplies int8 activation blocks: only under compute='int8'"
            if k.activations == "int8"
            else "multiplies float activations: compute='int8' asks for int8 blocks"
        )
    return k.check(w, dtype)


def choose_kernel(
    w: QuantWeights, rows: int, x_dtype: torch.dtype, *, kernel: str = "auto", compute: str = "auto"
) -> LinearChoice:
    """The kernel (and compute dtype) for ``rows`` activations of ``x_dtype`` times ``w``.

    Args:
        w: the layer's weights.
        rows: ``M``.
        x_dtype: the activations' dtype.
        kernel: a kernel name or ``"auto"`` (measured, memoised per shape bucket).
        compute: the compute-dtype policy (:data:`COMPUTE_POLICIES`).

    Raises:
        ValueError: an unknown kernel or policy, or a named kernel that cannot run ``w``.
    """
    dtype, reason = compute_dtype(x_dtype, compute)
    # inside a compiled graph the forcing context is not read (dynamo cannot trace a
    # ContextVar): the graph keeps what was measured or forced when it was traced
    compiling = torch.compiler.is_compiling()
    forced = kernel if kernel != "auto" else (None if compiling else _FORCED.get())
    act = "int8" if compute == "int8" else "float"
    rejected = {k.name: why for k in KERNELS.values() if (why := _reject(k, w, dtype, act))}
    if forced is None and act == "int8" and "q8tile" not in rejected and "q8dot" not in rejected:
        # one layout per layer: q8tile's tiles replace the rows, which q8dot reads
        rejected["q8dot"] = (
            "q8tile runs this layer from its tiled weights, the one layout kept "
            "(q8dot reads rows: name it to build them)"
        )
    if forced is not None:
        if forced not in KERNELS:
            raise ValueError(
                f"unknown kernel {forced!r}; expected 'auto' or one of {list(KERNELS)}"
            )
        if forced in rejected:
            raise ValueError(f"kernel {forced!r} cannot run this layer: {rejected[forced]}")
        return LinearChoice(forced, dtype, reason, "forced", rejected=rejected, rows=rows,
                            activations=act)  # fmt: skip
    bucket = _bucket(rows)
    key = (w.kind, w.out_features, w.in_features, w.group_size, bucket, dtype, x_dtype, act)
    memo = _MEMO.get(key)
    if memo is not None:
        return memo
    runnable = [k for k in KERNELS.values() if k.name not in rejected]
    if compiling:  # no timing inside a graph: a fixed rule (measure_kernels first avoids it)
        packed = [k.name for k in runnable]
        long = "q8dequant" if act == "int8" else "dequant"
        packed = [n for n in packed if n != long]
        name = packed[0] if packed and bucket <= 8 else long
        return LinearChoice(name, dtype, reason, "rule", rejected=rejected, rows=bucket,
                            activations=act)  # fmt: skip
    x = torch.randn(bucket, w.in_features, dtype=dtype)
    with torch.no_grad():
        timings = _time_all({k.name: functools.partial(k.run, w, x) for k in runnable})
    best = min(timings, key=lambda n: timings[n])
    choice = LinearChoice(best, dtype, reason, "measured", timings, rejected, bucket, act)
    _MEMO[key] = choice
    return choice


def run_kernel(w: QuantWeights, x: Tensor, choice: LinearChoice) -> Tensor:
    """``x [..., K] @ W^T -> [..., N]`` with ``choice``'s kernel, in ``x``'s dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).to(choice.compute_dtype).contiguous()  # [M, K]
    y = KERNELS[choice.chosen].run(w, x2)  # [M, N]
    return y.to(x.dtype).reshape(*lead, w.out_features)


def explain_linear(
    w: QuantWeights,
    rows: int = 1,
    x_dtype: torch.dtype = torch.float32,
    *,
    kernel: str = "auto",
    compute: str = "auto",
) -> LinearChoice:
    """The decision :func:`choose_kernel` makes (measuring now if it has not yet)."""
    return choose_kernel(w, rows, x_dtype, kernel=kernel, compute=compute)
