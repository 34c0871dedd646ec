"""An ``nn.Linear`` whose forward multiplies through laid-out copies of its weight (inference).

:class:`PackedLinearLayer` holds the very ``weight``/``bias`` parameters of the
``nn.Linear`` it replaces (same names, same objects: the state dict, tying and
``parameters()`` are unchanged) and a :class:`~attnlab.backends.linear_pack.PackedLinear`
that multiplies by them with the kernel measured fastest for the call's row count.
:meth:`PackedLinearLayer.unpack` gives the plain ``nn.Linear`` back. Built by
:func:`attnlab.models.inference.pack_model`.

Shape notation: ``N`` output features, ``K`` input features.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from attnlab.backends.linear_pack import PackedLinear

__all__ = ["PackedLinearLayer"]


class PackedLinearLayer(nn.Module):
    """``[..., K] -> [..., N]`` as ``linear`` computes it, through a packed weight.

    Args:
        linear: the float ``nn.Linear`` to take the parameters of.
        rows: the row counts to choose kernels for now.
        kernel: ``"auto"`` or a kernel of :data:`attnlab.backends.linear_pack.GEMM_KERNELS`.

    Raises:
        TypeError: ``linear`` is not an ``nn.Linear``.
        ValueError: its weight cannot be packed (dtype, device; the reason named).
    """

    def __init__(
        self, *, linear: nn.Linear, rows: Sequence[int] = (1, 2, 4, 8, 16, 32), kernel: str = "auto"
    ) -> None:
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter objects
        self.bias = linear.bias
        self.packed = PackedLinear(linear.weight, linear.bias, rows=rows, kernel=kernel)

    def forward(self, x: Tensor) -> Tensor:
        """``x [..., K] -> [..., N]`` (raises where gradients are needed)."""
        return self.packed(x)

    def unpack(self) -> nn.Linear:
        """The plain ``nn.Linear`` over the same parameters."""
        lin = nn.Linear(
            self.in_features,
            self.out_features,
            bias=self.bias is not None,
            device="meta",
            dtype=self.weight.dtype,
        )
        lin.weight = self.weight
        lin.bias = self.bias
        return lin

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, kernels={self.packed.explain()}"
        )
