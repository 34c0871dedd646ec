"""Low-rank adapters (LoRA) around any linear layer, by module replacement.

Shape notation: ``N`` any leading dimensions, ``I`` input features, ``O`` output features,
``r`` the adapter's rank.

LoRA (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models") freezes a
pretrained weight ``W`` and learns ``ΔW = B A`` with ``A: [r, I]`` and ``B: [O, r]``::

    y = base(x) + (α / r) · B A dropout(x)

``B`` starts at zero, so a freshly wrapped model computes what the base computes. rsLoRA
(Kalajdzievski, 2023, "A Rank Stabilization Scaling Factor for Fine-Tuning with LoRA")
scales by ``α / √r`` instead, which keeps the update's size steady as ``r`` grows.

:class:`LoRALinear` wraps any module that maps ``[N, I] -> [N, O]`` and says its
``in_features`` / ``out_features`` (``nn.Linear``, or a quantized layer such as
:class:`~attnlab.modules.nf4.NF4Linear` for QLoRA): the base is a component, so float and
quantized layers take adapters the same way, with no per-model code. The names follow
peft's (``base_layer``, ``lora_A``, ``lora_B``), so adapters move between the two by a
rename of the module paths alone.

Several wrappers may share one ``lora_A``: a fused projection (GPT-2's ``c_attn``, which
attnlab holds as separate q, k and v) adapted as one module has one ``A`` and a ``B`` whose
rows split into the parts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

__all__ = [
    "LoRALinear",
    "apply_lora",
    "is_linear_like",
    "lora_modules",
    "lora_state_dict",
    "mark_only_lora_trainable",
    "merge_and_unload",
    "merge_lora",
    "unmerge_lora",
]


def is_linear_like(module: nn.Module) -> bool:
    """Whether ``module`` maps ``[N, I] -> [N, O]`` and says ``in_features``/``out_features``."""
    return (
        not isinstance(module, LoRALinear)
        and isinstance(getattr(module, "in_features", None), int)
        and isinstance(getattr(module, "out_features", None), int)
    )


def _float_weight(base: nn.Module) -> Tensor:
    """The base's weight as a float ``[O, I]`` tensor (dequantized for quantized layers)."""
    dequantize = getattr(base, "dequantize", None)
    if callable(dequantize):
        w: Tensor = dequantize()
        return w
    weight = getattr(base, "weight", None)
    if not isinstance(weight, Tensor) or not weight.is_floating_point():
        raise TypeError(
            f"cannot read a float weight from {type(base).__name__}: a LoRA base needs a "
            "floating-point `weight` or a `dequantize()` method"
        )
    return weight


def _writable(y: Tensor) -> bool:
    """Whether the base's output may be added to in place: a fresh tensor of its own
    (not a view of another, not a leaf that wants a gradient), contiguous."""
    return y.is_contiguous() and not y._is_view() and not (y.is_leaf and y.requires_grad)


class LoRALinear(nn.Module):
    """``base(x) + scaling · lora_B(lora_A(dropout(x)))`` (Hu et al., 2021).

    Args:
        base_layer: the frozen layer, ``[N, I] -> [N, O]``, with ``in_features`` and
            ``out_features`` (``nn.Linear`` or a quantized linear layer).
        rank: ``r``, the adapter's rank (positive).
        alpha: ``α``; the update is scaled by ``α / r`` (``α / √r`` with ``use_rslora``).
        dropout: dropout on the adapter's input while training, in ``[0, 1)``.
        use_rslora: rank-stabilised scaling (Kalajdzievski, 2023).
        lora_A: a shared ``A`` (``nn.Linear(I, r, bias=False)``) for the parts of a fused
            projection; a new one (Kaiming-uniform, as in peft) when None.
        dtype: the adapters' dtype (default: float32, or the base's float dtype).

    Raises:
        ValueError: a non-positive rank, a dropout outside ``[0, 1)``, a shared ``lora_A``
            of another shape.
        TypeError: a base without integer ``in_features``/``out_features``.
    """

    @property
    def weight(self) -> Tensor:
        """The frozen base layer's weight (code that reads ``layer.weight.dtype`` sees it)."""
        return self.base_layer.weight  # type: ignore[return-value]

    def __init__(
        self,
        *,
        base_layer: nn.Module,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        use_rslora: bool = False,
        lora_A: nn.Linear | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not is_linear_like(base_layer):
            raise TypeError(
                "LoRA wraps a layer with integer in_features and out_features (nn.Linear or "
                f"a quantized linear layer), got {type(base_layer).__name__}"
            )
        if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
            raise ValueError(f"LoRA rank must be a positive integer, got {rank!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
            raise ValueError(f"LoRA alpha must be a positive number, got {alpha!r}")
        if isinstance(dropout, bool) or not isinstance(dropout, int | float):
            raise ValueError(f"LoRA dropout must be a number in [0, 1), got {dropout!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout!r}")
        i, o = int(base_layer.in_features), int(base_layer.out_features)  # type: ignore[arg-type]
        if dtype is None:
            w = getattr(base_layer, "weight", None)
            floating = isinstance(w, Tensor) and w.is_floating_point()
            dtype = w.dtype if floating else torch.float32  # type: ignore[union-attr]
        device = next((t.device for t in base_layer.parameters()), None)
        self.base_layer = base_layer
        self.in_features, self.out_features = i, o
        self.rank, self.alpha, self.use_rslora = rank, float(alpha), bool(use_rslora)
        self.scaling = float(alpha) / (math.sqrt(rank) if use_rslora else rank)
        if lora_A is None:
            lora_A = nn.Linear(i, rank, bias=False, device=device, dtype=dtype)
            nn.init.kaiming_uniform_(lora_A.weight, a=math.sqrt(5))
        elif tuple(lora_A.weight.shape) != (rank, i):
            raise ValueError(
                f"a shared lora_A must have shape (rank, in_features) = {(rank, i)}, got "
                f"{tuple(lora_A.weight.shape)}"
            )
        self.lora_A = lora_A
        self.lora_B = nn.Linear(rank, o, bias=False, device=device, dtype=dtype)
        nn.init.zeros_(self.lora_B.weight)
        self.lora_dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False

    def forward(self, x: Tensor) -> Tensor:
        y: Tensor = self.base_layer(x)  # [N, O]
        if self.merged:
            return y
        a, b = self.lora_A.weight, self.lora_B.weight
        h = self.lora_A(self.lora_dropout(x.to(a.dtype)))  # [N, r]
        if y.dtype == h.dtype == b.dtype and _writable(y):
            # y += s · h Bᵀ in place: no [N, O] temporaries (the base's backward does not
            # read its output, and autograd would refuse if a custom base's did)
            y2 = y.view(-1, self.out_features)  # [N, O]
            y2.addmm_(h.reshape(-1, self.rank), b.t(), alpha=self.scaling)
            return y
        return y + (self.lora_B(h) * self.scaling).to(y.dtype)

    def delta_weight(self) -> Tensor:
        """``scaling · B A``, ``[O, I]``."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    def merge(self) -> None:
        """Add ``ΔW`` into the base's float weight (a no-op when already merged).

        Raises:
            TypeError: the base has no float weight (a quantized base cannot hold the
                merged weight: use :func:`merge_and_unload`).
        """
        if self.merged:
            return
        w = getattr(self.base_layer, "weight", None)
        if not isinstance(w, Tensor) or not w.is_floating_point():
            raise TypeError(
                f"cannot merge into {type(self.base_layer).__name__}: its weight is not "
                "floating point; merge_and_unload() builds a float layer instead"
            )
        with torch.no_grad():
            w.add_(self.delta_weight().to(w.dtype))
        self.merged = True

    def unmerge(self) -> None:
        """Subtract ``ΔW`` again (a no-op when not merged)."""
        if not self.merged:
            return
        w = self.base_layer.weight
        assert isinstance(w, Tensor)
        with torch.no_grad():
            w.sub_(self.delta_weight().to(w.dtype))
        self.merged = False

    def merged_linear(self) -> nn.Linear:
        """A new ``nn.Linear`` holding ``W + ΔW`` (and the base's bias), float."""
        w = _float_weight(self.base_layer)
        if not self.merged:  # a merged base holds W + ΔW already
            w = w + self.delta_weight().to(w.dtype)
        bias = getattr(self.base_layer, "bias", None)
        dtype = w.dtype if w.is_floating_point() else torch.float32
        out = nn.Linear(
            self.in_features, self.out_features, bias=bias is not None, dtype=dtype, device=w.device
        )
        with torch.no_grad():
            out.weight.copy_(w)
            if bias is not None:
                out.bias.copy_(bias)
        return out

    def extra_repr(self) -> str:
        return (
            f"rank={self.rank}, alpha={self.alpha:g}, scaling={self.scaling:g}"
            + (", rslora" if self.use_rslora else "")
            + (", merged" if self.merged else "")
        )


def _set_submodule(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, name, module)


def apply_lora(
    model: nn.Module,
    paths: Sequence[str | list[str]],
    *,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    use_rslora: bool = False,
    dtype: torch.dtype | None = None,
    freeze: bool = True,
) -> nn.Module:
    """Wrap the linear layers at ``paths`` in :class:`LoRALinear`, in place.

    Args:
        model: any model.
        paths: module paths (``"layers.0.self_attention.q_proj"``); a list of paths inside
            ``paths`` is a fused group that shares one ``lora_A`` (the parts of GPT-2's
            ``c_attn``).
        rank, alpha, dropout, use_rslora, dtype: see :class:`LoRALinear`.
        freeze: leave only the adapters trainable (:func:`mark_only_lora_trainable`).

    Returns:
        ``model``.

    Raises:
        ValueError: no paths, a path that is not a module, a module that is not linear or
            already wrapped, fused parts with different inputs.
    """
    if not paths:
        raise ValueError("apply_lora needs at least one module path to adapt")
    groups = [[p] if isinstance(p, str) else list(p) for p in paths]
    seen: set[str] = set()
    for group in groups:
        shared: nn.Linear | None = None
        for path in group:
            if path in seen:
                raise ValueError(f"module {path!r} is named twice in the LoRA targets")
            seen.add(path)
            try:
                base = model.get_submodule(path)
            except AttributeError:
                raise ValueError(f"{path!r} is not a module of {type(model).__name__}") from None
            if isinstance(base, LoRALinear):
                raise ValueError(f"{path!r} already has a LoRA adapter")
            if not is_linear_like(base):
                raise ValueError(
                    f"{path!r} is a {type(base).__name__}, not a linear layer; LoRA adapts "
                    "layers with in_features and out_features"
                )
            wrapped = LoRALinear(
                base_layer=base,
                rank=rank,
                alpha=alpha,
                dropout=dropout,
                use_rslora=use_rslora,
                lora_A=shared,
                dtype=dtype,
            )
            shared = wrapped.lora_A if len(group) > 1 else None
            _set_submodule(model, path, wrapped)
    if freeze:
        mark_only_lora_trainable(model)
    return model


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    """``(path, wrapper)`` for every adapter in ``model``."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield name, module


def mark_only_lora_trainable(model: nn.Module) -> None:
    """``requires_grad`` on adapter weights only: the optimizer holds state for them alone."""
    adapters = {id(p) for _, m in lora_modules(model) for n, p in m.named_parameters()}
    bases = {id(p) for _, m in lora_modules(model) for p in m.base_layer.parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in adapters and id(p) not in bases)


def lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """``{path.lora_A.weight: A, path.lora_B.weight: B}`` for every adapter."""
    out: dict[str, Tensor] = {}
    for name, m in lora_modules(model):
        out[f"{name}.lora_A.weight"] = m.lora_A.weight.detach()
        out[f"{name}.lora_B.weight"] = m.lora_B.weight.detach()
    return out


def _each(model: nn.Module, fn: Callable[[LoRALinear], None]) -> None:
    found = False
    for _, m in lora_modules(model):
        fn(m)
        found = True
    if not found:
        raise ValueError(f"{type(model).__name__} has no LoRA adapters")


def merge_lora(model: nn.Module) -> None:
    """Add every adapter's ``ΔW`` into its base weight (the adapters stay, switched off)."""
    _each(model, LoRALinear.merge)


def unmerge_lora(model: nn.Module) -> None:
    """Undo :func:`merge_lora`."""
    _each(model, LoRALinear.unmerge)


def merge_and_unload(model: nn.Module) -> nn.Module:
    """Replace every wrapper by a plain ``nn.Linear`` holding ``W + ΔW``, in place.

    A quantized base is dequantized into the float layer (QLoRA's merged export).
    Returns ``model``.
    """
    wrapped = list(lora_modules(model))
    if not wrapped:
        raise ValueError(f"{type(model).__name__} has no LoRA adapters")
    for path, m in wrapped:
        _set_submodule(model, path, m.merged_linear())
    return model
