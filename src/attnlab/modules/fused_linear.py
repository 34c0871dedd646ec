"""Several linears of one input as one matmul (inference): fused q/k/v, fused gate/up.

Self-attention projects the same ``x`` three times (``q_proj``, ``k_proj``, ``v_proj``) and
a gated MLP twice (``gate_proj``, ``up_proj``). A decode step multiplies a few rows, so each
of those calls costs about as much in launch and dispatch as in arithmetic; stacking the
weights along the output features makes one call of each group, 4 matmuls per layer
instead of 7 (vLLM's ``QKVParallelLinear`` and ``MergedColumnParallelLinear`` hold their
weights this way, as GGUF's ``attn_qkv`` tensor does for the architectures that store one):

    y = x [W_q; W_k; W_v]^T + [b_q; b_k; b_v]        # [..., N_q + N_k + N_v]
    q, k, v = y.split((N_q, N_k, N_v), dim=-1)      # views, no copy

:class:`FusedProjection` is derived, inference-only state: it keeps references to the
layers it was built from (never registered as submodules, so ``state_dict``,
``parameters()`` and tying are unchanged) and a concatenated copy of their weights,
multiplied by a :class:`~attnlab.backends.linear_pack.PackedLinear` (its kernel measured per
row bucket like any other linear) for float32/bfloat16 CPU weights, ``F.linear``
elsewhere, or one quantized layer joined from int8/int4 (GGUF Q8_0/Q4_0/Q4_1) layers
(``concat_quant_linears``: levels, scales and minimums concatenated, never re-rounded).
An eager call notices a source written in place, replaced or converted (version counters,
data pointers, dtypes) and builds the copy again; a compiled graph keeps the copy it was
traced with. A call that needs gradients raises. Built by
:func:`attnlab.models.fuse.fuse_projections`.

Shape notation: ``K`` input features, ``N_i`` output features of the ``i``-th layer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.backends.linear_pack import PackedLinear
from attnlab.modules.packed_linear import PackedLinearLayer

__all__ = ["FusedProjection", "fusion_refusal"]

log = logging.getLogger(__name__)

_FLOAT = (torch.float32, torch.bfloat16)


def _is_float_linear(layer: nn.Module) -> bool:
    return type(layer) in (nn.Linear, PackedLinearLayer)


def _weight(layer: nn.Module) -> Tensor:
    w = layer.weight
    assert isinstance(w, Tensor)
    return w


def _quant_base() -> type[nn.Module]:
    from attnlab.modules.quant_linear import QuantLinear

    return QuantLinear


def _quant_concat() -> Callable[[list[nn.Module]], nn.Module] | None:
    """The quantized layers' exact concatenation (levels, scales and minimums joined,
    never re-rounded), or None where this build has none."""
    try:
        from attnlab.modules.quant_concat import concat_quant_linears
    except ImportError:
        return None
    return concat_quant_linears  # type: ignore[return-value]


def fusion_refusal(layers: Sequence[nn.Module], names: Sequence[str]) -> str | None:
    """Why ``layers`` (named ``names``) cannot be multiplied as one, or None.

    Fusable: plain float ``nn.Linear`` (or packed) layers of one dtype and device, or
    quantized layers of one class, group size, kernel and compute policy
    (``attnlab.modules.quant_concat.concat_quant_linears`` joins them exactly); all of
    one input width.
    """
    if len(layers) < 2:
        return f"needs at least two layers, got {len(layers)}"
    kinds = {type(layer).__name__ for layer in layers}
    for layer, name in zip(layers, names):
        if type(layer).__name__ == "LoRALinear":
            return (
                f"{name} carries a LoRA adapter: merge it into the weights first "
                "(attnlab.modules.lora.merge_and_unload) or run unfused"
            )
        if not (_is_float_linear(layer) or isinstance(layer, _quant_base())):
            return f"{name} is a {type(layer).__name__}, not a float or quantized linear"
    if len({int(getattr(layer, "in_features", -1)) for layer in layers}) != 1:
        widths = [getattr(layer, "in_features", None) for layer in layers]
        return f"input widths differ: {dict(zip(names, widths))}"
    if all(_is_float_linear(layer) for layer in layers):
        ws = [_weight(layer) for layer in layers]
        if any(w.is_meta for w in ws):
            return "meta weights (not loaded yet)"
        if len({(w.dtype, w.device) for w in ws}) != 1 or ws[0].dtype not in _FLOAT:
            return f"weights of dtypes/devices {sorted({f'{w.dtype} on {w.device}' for w in ws})}"
        return None
    if len(kinds) != 1:
        return f"layers of different kinds: {sorted(kinds)}"
    if _quant_concat() is None:
        return "this build cannot concatenate quantized layers (no concat_quant_linears)"
    same = {(q.group_size, q.kernel, q.compute) for q in layers}  # type: ignore[union-attr]
    if len(same) != 1:
        return f"group sizes/kernels/compute policies differ: {sorted(map(str, same))}"
    return None


class FusedProjection:
    """``x [..., K] -> (y_1 [..., N_1], y_2 [..., N_2], ...)`` as each layer computes it, in
    one matmul over their weights stacked along the output features.

    Args:
        layers: the layers of one input to fuse (their order is the outputs' order).
        names: their names, for messages.
        rows: the row counts a float fused weight is laid out for
            (:class:`~attnlab.backends.linear_pack.PackedLinear`).
        kernel: ``"auto"`` or a kernel of :data:`attnlab.backends.linear_pack.GEMM_KERNELS`.

    Raises:
        ValueError: the layers cannot be fused (the reason, from :func:`fusion_refusal`).
    """

    def __init__(
        self,
        *,
        layers: Sequence[nn.Module],
        names: Sequence[str],
        rows: Sequence[int] = (1, 2, 4, 8, 16, 32),
        kernel: str = "auto",
    ) -> None:
        why = fusion_refusal(layers, names)
        if why is not None:
            raise ValueError(f"cannot fuse {list(names)}: {why}")
        self.layers = tuple(layers)  # a tuple: never registered as submodules
        self.names = tuple(names)
        self.widths = tuple(int(layer.out_features) for layer in layers)  # type: ignore[arg-type]
        self.rows, self.kernel = tuple(rows), kernel
        self.quantized = not _is_float_linear(layers[0])
        self.weight: Tensor | None = None
        self.bias: Tensor | None = None
        self.packed: PackedLinear | None = None
        self.quant: nn.Module | None = None
        self._build()

    def _sources(self) -> list[Tensor]:
        """The tensors the fused copy is derived from (weights, biases; a quantized
        layer's levels, scales and minimums, or the tiles that replaced them); read from
        the modules' own dicts (this runs at every eager call)."""
        out: list[Tensor] = []
        for layer in self.layers:
            if self.quantized:
                out.extend(t for t in layer._buffers.values() if t is not None)
                out.extend(t for t in getattr(layer, "tiles", None) or () if t is not None)
            else:
                out.append(_weight(layer))
            bias = layer._parameters.get("bias")
            if bias is not None:
                out.append(bias)
        return out

    def _stale(self) -> bool:
        """Whether a source was written in place, replaced, cast or moved since the copy
        was built (version counters and data pointers: a cast or a move gives a parameter
        new storage)."""
        now = self._sources()
        if len(now) != len(self._tensors) or any(a is not b for a, b in zip(now, self._tensors)):
            return True
        return [(t._version, t.data_ptr()) for t in now] != self._marks

    def _build(self) -> None:
        """Concatenate the sources (and lay the float copy out)."""
        self._tensors = self._sources()
        self._marks = [(t._version, t.data_ptr()) for t in self._tensors]
        self.packed = self.quant = self.weight = self.bias = None
        if self.quantized:
            concat = _quant_concat()
            assert concat is not None
            self.quant = concat(list(self.layers))
            return
        # a normal tensor even when fused under inference_mode (its version counter is read)
        with torch.inference_mode(False), torch.no_grad():
            w = torch.cat([_weight(layer).detach() for layer in self.layers])  # [sum N_i, K]
            biases = [getattr(layer, "bias", None) for layer in self.layers]
            b = None
            if any(x is not None for x in biases):  # a missing bias adds exact zeros
                b = torch.cat(
                    [
                        x.detach() if x is not None else w.new_zeros(n)
                        for x, n in zip(biases, self.widths)
                    ]
                )
        self.weight, self.bias = w, b
        if w.device.type == "cpu":
            self.packed = PackedLinear(w, b, rows=self.rows, kernel=self.kernel)

    @property
    def out_features(self) -> int:
        return sum(self.widths)

    @property
    def extra_bytes(self) -> int:
        """Bytes held beyond the sources: the concatenated copy and its layouts."""
        if self.quant is not None:
            return int(getattr(self.quant, "weight_nbytes", 0))
        assert self.weight is not None
        own = self.weight.numel() * self.weight.element_size()
        return own + (self.packed.extra_bytes if self.packed is not None else 0)

    def __call__(self, x: Tensor) -> tuple[Tensor, ...]:
        """``x [..., K] -> (y_i [..., N_i], ...)``, views of one ``[..., sum N_i]`` output.

        Raises:
            ValueError: gradients are needed (the fused copy does not follow an optimizer
                step: unfuse the model to train).
        """
        if torch.is_grad_enabled() and (
            x.requires_grad or any(t.requires_grad for t in self._tensors)
        ):
            raise ValueError(
                f"the fused projection of {list(self.names)} is for inference: this call "
                "needs gradients (grad mode is on and a weight or the input requires grad); "
                "run it under torch.no_grad()/torch.inference_mode(), or unfuse the model "
                "(attnlab.models.inference.unpack_model) to train"
            )
        if not torch.compiler.is_compiling() and self._stale():
            log.info("%s changed in place (or moved): fused again", list(self.names))
            self._build()
        if self.quant is not None:
            y = self.quant(x)
        elif self.packed is not None:
            y = self.packed(x)
        else:
            assert self.weight is not None
            y = F.linear(x, self.weight, self.bias)
        return y.split(self.widths, dim=-1)

    def __repr__(self) -> str:
        kind = type(self.quant).__name__ if self.quant is not None else "float"
        return f"FusedProjection({'+'.join(self.names)}, widths={self.widths}, {kind})"
