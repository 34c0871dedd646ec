"""The float dtype to compute in on this CPU: bfloat16 where it multiplies natively.

A bfloat16 matmul runs on AVX-512 (BF16) and AMX tiles through oneDNN several times
faster than float32, and was measured 10x *slower* than float32 on an AVX2-only machine
(emulated). So the choice is torch's own answer about this CPU
(``torch.ops.mkldnn._is_mkldnn_bf16_supported``), asked once, never a timing: the dtype
changes the numbers a model computes, so it is decided by a rule that ``explain`` can
state, and the kernels are then chosen by measurement within it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FLOAT_POLICIES", "DtypeChoice", "choose_float_dtype", "native_bf16"]

#: what ``dtype=`` accepts where a float dtype is chosen
FLOAT_POLICIES = ("auto", "float32", "bfloat16", "float16")
_NAMED = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_NATIVE_BF16: list[bool] = []  # asked once per process, then read (also inside graphs)


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX-512 BF16 / AMX via oneDNN).

    torch's own answer (``torch.ops.mkldnn._is_mkldnn_bf16_supported``), asked once and
    remembered: a compiled graph reads the remembered value instead of calling the op.
    """
    if not _NATIVE_BF16:
        try:
            ok = bool(
                torch.backends.mkldnn.is_available()
                and torch.ops.mkldnn._is_mkldnn_bf16_supported()
            )
        except (AttributeError, RuntimeError):  # pragma: no cover - builds without oneDNN
            ok = False
        _NATIVE_BF16.append(ok)
    return _NATIVE_BF16[0]


@dataclass(frozen=True)
class DtypeChoice:
    """The float dtype a model's weights and activations take, and why."""

    dtype: torch.dtype
    reason: str

    def __str__(self) -> str:
        return f"{self.dtype}: {self.reason}"


def choose_float_dtype(policy: str | torch.dtype = "auto") -> DtypeChoice:
    """The dtype for ``policy``: a dtype or its name is taken as asked; ``"auto"`` is
    bfloat16 where :func:`native_bf16`, float32 elsewhere.

    Raises:
        ValueError: a policy that is not one of :data:`FLOAT_POLICIES` or a float dtype.
    """
    if isinstance(policy, torch.dtype):
        if policy not in _NAMED.values():
            raise ValueError(f"dtype must be one of {list(FLOAT_POLICIES)}, got {policy}")
        return DtypeChoice(policy, f"dtype={policy} was asked for")
    if policy not in FLOAT_POLICIES:
        raise ValueError(f"dtype must be one of {list(FLOAT_POLICIES)}, got {policy!r}")
    if policy != "auto":
        return DtypeChoice(_NAMED[policy], f"dtype={policy!r} was asked for")
    if native_bf16():
        return DtypeChoice(
            torch.bfloat16, "this CPU multiplies bfloat16 natively (AVX-512 BF16/AMX, oneDNN)"
        )
    return DtypeChoice(
        torch.float32, "no native bfloat16 matmul on this CPU (bfloat16 would be emulated, slower)"
    )
