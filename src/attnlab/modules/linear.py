"""The one factory for a model's linear layers: float, int8 or grouped int4.

Every module that owns a projection builds it with :func:`make_linear`; a float model is
turned into a quantized one layer by layer with :func:`convert_linear` (what
:func:`attnlab.models.quantize.quantize_model` applies to a whole model). Adapters
(LoRA/QLoRA) wrap whatever this factory returned, so they compose with quantization
without per-model code. A :class:`LinearSpec` says which kind of layer to make:

    LinearSpec()                          # nn.Linear
    LinearSpec("int8")                    # int8, one scale per output channel
    LinearSpec("int8", group_size=32)     # int8 in groups of 32 (GGUF Q8_0)
    LinearSpec("int4", group_size=64)     # 4-bit levels, scale + minimum per 64 (Q4_1-like)
    LinearSpec.parse("int4:g128")         # the same as a string (CLI, configs)

Shape notation: ``N`` output features, ``K`` input features.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from attnlab.backends.qmatmul import COMPUTE_POLICIES, KERNELS
from attnlab.modules.quant_linear import Int4Linear, Int8Linear, QuantLinear

__all__ = ["WEIGHT_KINDS", "LinearSpec", "convert_linear", "make_linear"]

WEIGHT_KINDS = ("float", "int8", "int4")


@dataclass(frozen=True)
class LinearSpec:
    """Which linear layer the factory builds.

    Attributes:
        weights: ``"float"`` (``nn.Linear``), ``"int8"`` or ``"int4"``.
        group_size: input features per scale: None is one per output channel for int8
            and 32 for int4.
        kernel: ``"auto"`` (measured per shape) or a kernel name of
            :mod:`attnlab.backends.qmatmul`.
        compute: the activations' dtype policy (``"auto"``: bfloat16 where the CPU has
            native bfloat16 matmul).
    """

    weights: str = "float"
    group_size: int | None = None
    kernel: str = "auto"
    compute: str = "auto"

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_KINDS:
            raise ValueError(f"weights must be one of {list(WEIGHT_KINDS)}, got {self.weights!r}")
        if self.group_size is not None and (
            isinstance(self.group_size, bool)
            or not isinstance(self.group_size, int)
            or self.group_size < 2
        ):
            raise ValueError(f"group_size must be an int >= 2 or None, got {self.group_size!r}")
        if self.weights == "float" and self.group_size is not None:
            raise ValueError(f"float weights take no group_size, got {self.group_size}")
        if self.kernel != "auto" and self.kernel not in KERNELS:
            raise ValueError(
                f"kernel must be 'auto' or one of {list(KERNELS)}, got {self.kernel!r}"
            )
        if self.compute not in COMPUTE_POLICIES:
            raise ValueError(
                f"compute must be one of {list(COMPUTE_POLICIES)}, got {self.compute!r}"
            )

    @property
    def quantized(self) -> bool:
        return self.weights != "float"

    @property
    def effective_group(self) -> int | None:
        """The group size the layers get (int4 defaults to 32)."""
        if self.weights == "int4" and self.group_size is None:
            return 32
        return self.group_size

    @classmethod
    def parse(cls, value: str | LinearSpec | None) -> LinearSpec:
        """``"int8"``, ``"int8:g32"``, ``"int4"``, ``"int4:g64"``, ``"float"`` (or a spec).

        Raises:
            ValueError: any other string, named with the accepted forms.
        """
        if value is None:
            return cls()
        if isinstance(value, LinearSpec):
            return value
        if not isinstance(value, str):
            raise TypeError(
                f"quantize must be a string such as 'int8' or 'int4:g32', got {type(value).__name__}"
            )
        kind, _, rest = value.strip().lower().partition(":")
        group: int | None = None
        if rest:
            if not (rest.startswith("g") and rest[1:].isdigit()):
                raise ValueError(
                    f"quantize {value!r}: the group is written ':g<size>' (e.g. 'int4:g64')"
                )
            group = int(rest[1:])
        if kind not in WEIGHT_KINDS:
            raise ValueError(
                f"quantize must be 'float', 'int8', 'int8:g<size>', 'int4' or 'int4:g<size>', "
                f"got {value!r}"
            )
        return cls(kind, group)

    def to_dict(self) -> dict[str, Any]:
        """The spec as JSON data (recorded beside quantized weights)."""
        return {"weights": self.weights, "group_size": self.effective_group}

    def __str__(self) -> str:
        g = self.effective_group
        return self.weights if g is None else f"{self.weights}:g{g}"


def make_linear(
    in_features: int,
    out_features: int,
    *,
    bias: bool = True,
    spec: LinearSpec | str | None = None,
) -> Any:
    """A linear layer ``[..., K] -> [..., N]`` of the kind ``spec`` names (``bias``
    defaults to True, as ``nn.Linear``'s does). Typed ``Any``: the kinds share the call
    (``[..., K] -> [..., N]``) and ``in_features``/``out_features``/``bias``, not ``weight``.

    The float kind is a plain ``nn.Linear`` (same parameters, same state-dict names); the
    quantized kinds start with zero weights, to be loaded (``load_state_dict``,
    ``set_weights``, or the GGUF reader's blocks).

    Raises:
        ValueError: a bad spec, or a group size that does not divide ``in_features``.
    """
    s = LinearSpec.parse(spec)
    if s.weights == "float":
        return nn.Linear(in_features, out_features, bias=bias)
    kwargs: dict[str, Any] = {"kernel": s.kernel, "compute": s.compute}
    if s.weights == "int8":
        return Int8Linear(
            in_features=in_features,
            out_features=out_features,
            group_size=s.group_size,
            bias=bias,
            **kwargs,
        )
    return Int4Linear(
        in_features=in_features,
        out_features=out_features,
        group_size=s.effective_group or 32,
        bias=bias,
        **kwargs,
    )


def convert_linear(linear: nn.Module, spec: LinearSpec | str) -> nn.Module:
    """``linear`` as the kind ``spec`` names (quantized from its float weights).

    A layer already of that kind is returned as it is; a quantized layer is never
    re-quantized to another kind (that would round twice).

    Raises:
        TypeError: ``linear`` is not an ``nn.Linear`` or quantized layer.
        ValueError: a quantized layer asked to become another kind.
    """
    s = LinearSpec.parse(spec)
    if isinstance(linear, QuantLinear):
        if linear.kind == s.weights and linear.group_size == (
            s.effective_group or linear.in_features
        ):
            return linear
        raise ValueError(
            f"this layer is already {linear.kind} (groups of {linear.group_size}); re-quantizing it "
            f"as {s} would round twice: start from the float model"
        )
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"convert_linear takes an nn.Linear, got {type(linear).__name__}")
    if s.weights == "float":
        return linear
    kwargs: dict[str, Any] = {"kernel": s.kernel, "compute": s.compute}
    if s.weights == "int8":
        return Int8Linear.from_float(linear, group_size=s.group_size, **kwargs)
    return Int4Linear.from_float(linear, group_size=s.effective_group or 32, **kwargs)
