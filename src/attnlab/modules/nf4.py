"""4-bit NormalFloat (NF4) linear layers: the frozen base of QLoRA.

Shape notation: ``N`` any leading dimensions, ``I`` input features, ``O`` output features,
``G`` blocks of ``block_size`` weights.

QLoRA (Dettmers et al., 2023, "QLoRA: Efficient Finetuning of Quantized LLMs") stores the
frozen weight in NF4: the weight matrix, read in row-major order, is cut into blocks of 64;
each block is divided by its absolute maximum and each value is replaced by the nearest of
16 levels, the quantiles of a standard normal distribution rescaled to ``[-1, 1]`` with an
exact zero (8 positive levels, 7 negative). Two codes share a byte. The matmul
dequantizes the weight to the input's dtype and runs a float matmul; the backward
dequantizes again instead of keeping a float copy, so the layer never holds more than
the 4-bit codes and one float scale per block (0.5625 bytes per weight). Double
quantization of the scales (the paper's third idea) is not done here: it saves a further
0.37 bits per weight.

The error is stated per weight: ``|w - ŵ| ≤ absmax(block) · gap / 2``, where ``gap`` is
the distance between the two levels around ``w / absmax``; so a forward's error is at most
``|x| · |W - Ŵ|ᵀ`` entry by entry (:meth:`NF4Linear.error_bound`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["NF4Linear", "nf4_dequantize", "nf4_levels", "nf4_quantize", "quantize_linears"]

_OFFSET = 0.9677083  # the outermost quantile, (1 - 1/(2·15) + 1 - 1/(2·16)) / 2 in the paper
BLOCK_SIZE = 64


@functools.cache
def _levels() -> Tensor:
    ndtri = torch.special.ndtri
    pos = ndtri(torch.linspace(_OFFSET, 0.5, 9, dtype=torch.float64)[:-1])  # 8 positive
    neg = -ndtri(torch.linspace(_OFFSET, 0.5, 8, dtype=torch.float64)[:-1])  # 7 negative
    levels = torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg]).sort().values
    return (levels / levels.abs().max()).float()


def nf4_levels() -> Tensor:
    """The 16 NF4 levels, ascending, in ``[-1, 1]`` with an exact 0 (float32).

    The paper's construction: quantiles ``Φ⁻¹`` at evenly spaced probabilities, 8 from
    the upper half of the normal distribution and 7 from the lower, normalised by the
    largest.
    """
    return _levels().clone()


def nf4_quantize(weight: Tensor, block_size: int = BLOCK_SIZE) -> tuple[Tensor, Tensor]:
    """``(codes, absmax)``: two 4-bit codes per byte ``[ceil(O·I / 2)]`` and ``[G]`` scales.

    Raises:
        ValueError: a weight that is not 2-d floating point, or an odd or non-positive
            block size.
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"NF4 quantizes a 2-d float weight, got shape {tuple(weight.shape)} {weight.dtype}"
        )
    if not isinstance(block_size, int) or block_size <= 0 or block_size % 2:
        raise ValueError(f"block_size must be a positive even integer, got {block_size!r}")
    flat = weight.detach().float().reshape(-1)
    n = flat.numel()
    pad = (-n) % block_size
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, block_size)  # [G, block]
    absmax = blocks.abs().amax(dim=1)  # [G]
    scaled = blocks / absmax.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    levels = nf4_levels().to(weight.device)
    mid = (levels[1:] + levels[:-1]) / 2  # decision boundaries
    codes = torch.bucketize(scaled.reshape(-1), mid).to(torch.uint8)[: n + (n % 2)]
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    packed = (codes[0::2] << 4) | codes[1::2]  # [ceil(n / 2)]
    return packed, absmax


def nf4_dequantize(
    packed: Tensor,
    absmax: Tensor,
    shape: tuple[int, int],
    *,
    block_size: int = BLOCK_SIZE,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The ``[O, I]`` weight in ``dtype`` from :func:`nf4_quantize`'s codes and scales."""
    n = shape[0] * shape[1]
    codes = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[:n].long()
    levels = _levels().to(packed.device)
    scale = absmax.repeat_interleave(block_size)[:n]
    return (levels[codes] * scale).view(shape).to(dtype)


class _NF4Matmul(torch.autograd.Function):
    """``x Ŵᵀ`` that dequantizes ``Ŵ`` again in the backward instead of saving it."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, layer: NF4Linear) -> Tensor:
        ctx.layer = layer
        return x @ layer.dequantize(x.dtype).T

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad @ ctx.layer.dequantize(grad.dtype), None


class NF4Linear(nn.Module):
    """A frozen linear layer held in NF4 (Dettmers et al., 2023), ``[N, I] -> [N, O]``.

    Args:
        in_features, out_features: the layer's sizes.
        bias: keep a (float, frozen) bias.
        block_size: weights per absmax block (the paper's 64).

    Build one from a float layer with :meth:`from_linear`. The weight gets no gradient
    (QLoRA trains adapters on top of it); the input does.
    """

    def __init__(
        self, *, in_features: int, out_features: int, bias: bool = True, block_size: int = 64
    ) -> None:
        super().__init__()
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        self.in_features, self.out_features, self.block_size = in_features, out_features, block_size
        n = in_features * out_features
        groups = -(-n // block_size)
        self.codes: Tensor
        self.absmax: Tensor
        self.register_buffer("codes", torch.zeros((n + 1) // 2, dtype=torch.uint8))
        self.register_buffer("absmax", torch.zeros(groups))
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, block_size: int = BLOCK_SIZE) -> NF4Linear:
        """Quantize ``linear``'s weight (its bias stays float)."""
        layer = cls(
            in_features=linear.in_features,
            out_features=linear.out_features,
            bias=linear.bias is not None,
            block_size=block_size,
        )
        codes, absmax = nf4_quantize(linear.weight, block_size)
        layer.codes.copy_(codes)
        layer.absmax.copy_(absmax)
        layer.to(linear.weight.device)
        if linear.bias is not None and layer.bias is not None:
            layer.bias.data = linear.bias.detach().float().clone()
        return layer

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``Ŵ``, ``[O, I]`` in ``dtype``."""
        return nf4_dequantize(
            self.codes,
            self.absmax,
            (self.out_features, self.in_features),
            block_size=self.block_size,
            dtype=dtype,
        )

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        y: Tensor = _NF4Matmul.apply(x, self)  # [N, O]
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def error_bound(self, weight: Tensor) -> Tensor:
        """``|W - Ŵ|`` bound per weight: half the gap between the levels around ``w``."""
        levels = nf4_levels().to(weight.device)
        gaps = levels[1:] - levels[:-1]
        n = weight.numel()
        scale = self.absmax.repeat_interleave(self.block_size)[:n].view_as(weight)
        u = (weight.float() / scale.clamp_min(torch.finfo(torch.float32).tiny)).clamp(-1, 1)
        idx = torch.bucketize(u, levels[1:-1])  # the gap u lies in
        return scale * gaps[idx] / 2

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, block_size={self.block_size}"
        )


def quantize_linears(model: nn.Module, paths: list[str], *, block_size: int = BLOCK_SIZE) -> None:
    """Replace the ``nn.Linear`` layers at ``paths`` by :class:`NF4Linear`, in place."""
    for path in paths:
        layer = model.get_submodule(path)
        if not isinstance(layer, nn.Linear):
            raise ValueError(f"{path!r} is a {type(layer).__name__}, not an nn.Linear to quantize")
        parent, _, name = path.rpartition(".")
        setattr(
            model.get_submodule(parent) if parent else model,
            name,
            NF4Linear.from_linear(layer, block_size=block_size),
        )
