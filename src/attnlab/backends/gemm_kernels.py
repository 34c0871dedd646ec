"""The float GEMM kernels of :mod:`attnlab.backends.linear_pack`: layouts, custom ops, calls.

``"linear"`` (``F.linear`` on the weight as it is), ``"mm_t"`` (``x @ Wt``, ``Wt [K, N]``
contiguous), ``"mkl"`` (MKL's packed GEMM for one row count: ``_mkl_reorder_linear_weight``
+ ``_mkl_linear``, what inductor's freezing emits) and ``"mkldnn"`` (oneDNN's prepacked
inner product: ``_reorder_linear_weight`` + ``_linear_pointwise``). The packed ones run
eagerly as the torch ops themselves and, inside a compiled graph, as custom ops with fake
kernels (inductor cannot lower the MKL/oneDNN ops on tensors that are graph inputs).

Shape notation: ``M`` rows, ``K`` input features, ``N`` output features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["GEMM_KERNELS", "gemm_unavailable", "prepare_gemm", "run_gemm"]

GEMM_KERNELS = ("linear", "mm_t", "mkl", "mkldnn")


# ----------------------------------------------------------------------------- custom ops


@torch.library.custom_op("attnlab_gemm::mkl_linear", mutates_args=())
def _mkl_op(x: Tensor, packed: Tensor, weight: Tensor, bias: Tensor | None, rows: int) -> Tensor:
    """MKL's packed GEMM ``x [M, K] -> [M, N]`` (``packed`` from
    ``_mkl_reorder_linear_weight(weight, rows)``), opaque to a graph."""
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)


@_mkl_op.register_fake
def _(x: Tensor, packed: Tensor, weight: Tensor, bias: Tensor | None, rows: int) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("attnlab_gemm::mkldnn_linear", mutates_args=())
def _mkldnn_op(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """oneDNN's prepacked inner product ``x [M, K] -> [M, N]``, opaque to a graph."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@_mkldnn_op.register_fake
def _(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    return x.new_empty(x.shape[0], out_features)


# ----------------------------------------------------------------------------- kernels


def gemm_unavailable(name: str, dtype: torch.dtype) -> str | None:
    """Why kernel ``name`` cannot multiply ``dtype`` weights here, or None.

    Raises:
        ValueError: an unknown kernel name.
    """
    if name not in GEMM_KERNELS:
        raise ValueError(f"unknown float GEMM kernel {name!r}; expected one of {GEMM_KERNELS}")
    if name == "mkl":
        if not torch._C.has_mkl:
            return "this torch build has no MKL"
        if dtype != torch.float32:
            return f"MKL's packed GEMM is float32 only, not {dtype}"
    if name == "mkldnn" and not (
        torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
    ):
        return "oneDNN (mkldnn) is unavailable or disabled in this torch"
    return None


def prepare_gemm(name: str, weight: Tensor, rows: int) -> Tensor | None:
    """The laid-out copy kernel ``name`` reads (None for ``"linear"``)."""
    w = weight.detach()
    with torch.no_grad():
        if name == "mm_t":
            return w.t().contiguous()  # [K, N]
        if name == "mkl":
            return torch.ops.mkl._mkl_reorder_linear_weight(w.contiguous(), rows)
        if name == "mkldnn":
            return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), rows)
    return None


def run_gemm(
    name: str, x2: Tensor, weight: Tensor, bias: Tensor | None, form: Tensor | None, rows: int
) -> Tensor:
    """``x2 [M, K] -> [M, N]`` with kernel ``name`` over its laid-out ``form``."""
    if name == "linear" or form is None:
        return F.linear(x2, weight, bias)
    if name == "mm_t":
        return torch.mm(x2, form) if bias is None else torch.addmm(bias, x2, form)
    eager = not torch.compiler.is_compiling()  # the ops themselves, without the wrapper
    if name == "mkl":
        if eager:
            return torch.ops.mkl._mkl_linear(x2, form, weight, bias, rows)
        return _mkl_op(x2, form, weight, bias, rows)
    if eager:
        return torch.ops.mkldnn._linear_pointwise(x2, form, bias, "none", [], "")
    return _mkldnn_op(x2, form, bias, weight.shape[0])
