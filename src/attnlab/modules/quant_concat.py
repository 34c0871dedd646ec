"""Quantized linear layers joined along their output features (q/k/v or gate/up in one call).

Shape notation: ``N_i`` each layer's output features, ``K`` input features.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from attnlab.modules.quant_linear import QuantLinear

__all__ = ["concat_quant_linears"]


def concat_quant_linears(layers: Sequence[QuantLinear]) -> QuantLinear:
    """One layer whose outputs are ``layers``' outputs side by side (q/k/v or gate/up
    fused into one call): ``y[..., :N_0]`` is the first layer's, and so on. Exact: the
    levels, scales and minimums are joined, never re-rounded.

    The layers must be of one class, input width, group, kernel and compute policy. A
    missing bias is zeros where another has one. Layers all in the tiled layout whose
    widths (but the last) are multiples of 16 are joined tile by tile (no round trip
    through rows); otherwise the rows are joined and the result tiles on first use.

    Raises:
        ValueError: no layers, or layers that differ in any of the above (the values named).
    """
    if not layers:
        raise ValueError("layers must hold at least one quantized linear layer, got none")
    first = layers[0]
    for i, layer in enumerate(layers):
        if not isinstance(layer, QuantLinear):
            raise TypeError(f"layers[{i}] must be a QuantLinear, got {type(layer).__name__}")
        got = (type(layer), layer.in_features, layer.group_size, layer.kernel, layer.compute)
        want = (type(first), first.in_features, first.group_size, first.kernel, first.compute)
        if got != want:
            raise ValueError(
                f"layers[{i}] is ({got[0].__name__}, in_features={got[1]}, group_size={got[2]}, "
                f"kernel={got[3]!r}, compute={got[4]!r}), layers[0] is ({want[0].__name__}, "
                f"in_features={want[1]}, group_size={want[2]}, kernel={want[3]!r}, "
                f"compute={want[4]!r}): only layers of one kind join"
            )
    bias = any(layer.bias is not None for layer in layers)
    out = type(first)(
        in_features=first.in_features,
        out_features=sum(layer.out_features for layer in layers),
        group_size=first.group_size,
        bias=bias,
        kernel=first.kernel,
        compute=first.compute,
    )
    tiled = [layer.tiles for layer in layers]
    widths_fit = all(layer.out_features % 16 == 0 for layer in layers[:-1])
    if all(t is not None for t in tiled) and widths_fit:
        parts = [t for t in tiled if t is not None]
        dtypes = {p[1].dtype for p in parts}  # float16 where exact, per layer: else float32
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        lv = torch.cat([p[0] for p in parts])  # [T, B, 8 | 4, 16, 4]: tiles are independent
        st = torch.cat([p[1].to(dtype) for p in parts])  # [T, B, 16]
        mins = [p[2].to(dtype) for p in parts if p[2] is not None]
        out.set_tiles((lv, st, torch.cat(mins) if mins else None), first.scales.dtype)
    else:
        with torch.no_grad():
            for name in ("qweight", "scales", "mins"):
                if hasattr(out, name):
                    getattr(out, name).copy_(
                        torch.cat([layer.row_tensor(name) for layer in layers])
                    )
    if out.bias is not None:
        with torch.no_grad():
            out.bias.copy_(
                torch.cat([
                    torch.zeros(layer.out_features) if layer.bias is None else layer.bias.detach()
                    for layer in layers
                ])
            )  # fmt: skip
    return out
