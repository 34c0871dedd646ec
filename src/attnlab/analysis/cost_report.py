"""What :func:`attnlab.analysis.cost.estimate` returns, and how its numbers are printed.

* :class:`ComponentCost` and :class:`CostReport`: the work and memory of one estimate;
* :func:`human_bytes`, :func:`human_flops`: the units a person reads;
* :func:`dtype_bytes`: bytes per element of a dtype given as a ``torch.dtype`` or a name
  (without importing torch: the CLI's ``estimate`` never does).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from attnlab.analysis.arch import ArchSpec

__all__ = ["ComponentCost", "CostReport", "dtype_bytes", "human_bytes", "human_flops"]

_DTYPE_NAMES: dict[str, tuple[str, int]] = {
    "fp32": ("float32", 4),
    "float32": ("float32", 4),
    "float": ("float32", 4),
    "fp16": ("float16", 2),
    "float16": ("float16", 2),
    "half": ("float16", 2),
    "bf16": ("bfloat16", 2),
    "bfloat16": ("bfloat16", 2),
    "fp64": ("float64", 8),
    "float64": ("float64", 8),
}


def _dtype(dtype: Any) -> tuple[str, int]:
    """``(name, bytes per element)`` of a floating ``torch.dtype`` or its name.

    Works without importing torch (the CLI's ``estimate`` never does).
    """
    if isinstance(dtype, str):
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(_DTYPE_NAMES)}")
        return _DTYPE_NAMES[dtype]
    if type(dtype).__name__ != "dtype" or not getattr(dtype, "is_floating_point", False):
        raise ValueError(f"dtype must be a floating torch.dtype or its name, got {dtype!r}")
    return str(dtype).removeprefix("torch."), int(dtype.itemsize)


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a floating dtype, given as ``torch.float16`` or ``"bf16"``/``"float16"``.

    Raises:
        ValueError: an unknown name or a non-floating dtype.
    """
    return _dtype(dtype)[1]


@dataclass
class ComponentCost:
    """Work and memory of one component, summed over layers.

    Attributes:
        flops: all FLOPs for the mode (matmul + element-wise).
        matmul_flops: the matmul part.
        activation_bytes: activations this component holds at the peak (saved for backward
            in training; live tensors in inference).
    """

    flops: float = 0.0
    matmul_flops: float = 0.0
    activation_bytes: float = 0.0

    def add(self, *, mm: float = 0.0, ew: float = 0.0, act: float = 0.0) -> None:
        self.matmul_flops += mm
        self.flops += mm + ew
        self.activation_bytes += act


@dataclass
class CostReport:
    """What :func:`estimate` computes. FLOPs are for the whole mode (training: forward +
    backward; decode: one step); bytes are totals over the batch.

    Attributes:
        arch: the architecture described.
        mode: ``"inference"``, ``"training"`` or ``"decode"``.
        batch_size: sequences.
        seq_len: tokens per sequence (decode: tokens already in the cache).
        new_tokens: decode only: tokens produced in the step.
        dtype: the compute/parameter dtype's name.
        backend: the attention backend costed (``auto`` resolved).
        checkpointing: gradient checkpointing per layer (training).
        by_component: :class:`ComponentCost` per component name.
        flops: total FLOPs.
        matmul_flops: the matmul part of ``flops``.
        forward_matmul_flops: matmul FLOPs of one forward pass.
        attention_density: fraction of (query, key) pairs the mask keeps.
        parameter_count: parameters.
        parameter_bytes: parameter memory.
        gradient_bytes: gradient memory (training).
        optimizer_bytes: optimizer state (training).
        kv_cache_bytes: KV-cache memory (decode).
        activation_bytes: peak activation memory for ``backend`` and ``checkpointing``.
        activation_variants: activation bytes for materialised/tiled attention with and
            without checkpointing (training) or materialised/tiled (inference).
        score_matrix_bytes: one layer's ``B x H x L x S`` score matrix.
        total_bytes: parameters + gradients + optimizer + KV cache + activations.
        notes: assumptions that shaped the numbers.
        active_parameter_count: parameters one token uses (MoE: ``k`` of ``E`` experts;
            dense: all).
        all_to_all_bytes: on-paper bytes expert parallelism moves for this pass
            (``expert_parallel`` devices; 0 without MoE or with one device).
        layer_backends: a mixed layout's backend per group of layers (``"local layers
            (window 4096)"``, ``"global layers"``); empty for uniform layers.
    """

    arch: ArchSpec
    mode: str
    batch_size: int
    seq_len: int
    new_tokens: int
    dtype: str
    backend: str
    checkpointing: bool
    by_component: dict[str, ComponentCost]
    flops: float
    matmul_flops: float
    forward_matmul_flops: float
    attention_density: float
    parameter_count: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    kv_cache_bytes: int
    activation_bytes: int
    activation_variants: dict[str, int]
    score_matrix_bytes: int
    total_bytes: int
    notes: list[str] = field(default_factory=list)
    active_parameter_count: int = 0
    all_to_all_bytes: float = 0.0
    layer_backends: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``json.dumps``."""
        d = asdict(self)
        d["arch"] = asdict(self.arch)
        return d

    def summary(self) -> str:
        """A few lines a person reads."""
        lines = [
            f"{self.arch.name} ({self.arch.attention_kind}), mode={self.mode}, batch={self.batch_size}, "
            f"seq_len={self.seq_len}, dtype={self.dtype}, backend={self.backend}"
            + (", checkpointing" if self.checkpointing else ""),
            f"  FLOPs {human_flops(self.flops)} (matmul {human_flops(self.matmul_flops)})",
            f"  parameters {self.parameter_count:,} = {human_bytes(self.parameter_bytes)}",
        ]
        if self.arch.moe is not None:
            lines.append(
                f"  active parameters per token {self.active_parameter_count:,} "
                f"({self.active_parameter_count / self.parameter_count:.1%})"
            )
            if self.all_to_all_bytes:
                lines.append(f"  expert-parallel all-to-all {human_bytes(self.all_to_all_bytes)}")
        if self.mode == "training":
            lines.append(
                f"  gradients {human_bytes(self.gradient_bytes)}, optimizer state "
                f"{human_bytes(self.optimizer_bytes)}"
            )
        if self.kv_cache_bytes:
            lines.append(f"  KV cache {human_bytes(self.kv_cache_bytes)}")
        lines.append(f"  activations {human_bytes(self.activation_bytes)}")
        lines.append(f"  total {human_bytes(self.total_bytes)}")
        lines.append("  by component:")
        for name, c in self.by_component.items():
            if c.flops or c.activation_bytes:
                lines.append(
                    f"    {name:<17} {human_flops(c.flops):>10}  {human_bytes(c.activation_bytes):>10}"
                )
        return "\n".join(lines)


def human_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_flops(n: float) -> str:
    """``2.5e9 -> '2.50 GFLOP'``."""
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} FLOP"
