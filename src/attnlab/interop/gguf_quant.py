"""GGUF quantized tensors placed in attnlab's quantized layers, repacked once, never as floats.

:func:`attnlab.functional.gguf_blocks.split_blocks` gives a tensor's stored levels and
per-group scales (and minimums); this module puts them, row by row, into the layer whose
layout is the same arithmetic:

- a symmetric format (``w = scale * q``: Q8_0, Q5_0, Q4_0's centred levels too, Q6_K,
  Q3_K) -> :class:`~attnlab.modules.quant_linear.Int8Linear` with the format's group;
- a format with minimums and levels in ``0..15`` (``w = scale * q + min``: Q4_1, Q4_K,
  Q2_K) -> :class:`~attnlab.modules.quant_linear.Int4Linear` with the format's group;
  Q4_0 goes here too, as ``scale * (q + 8) - 8 scale``, so that it runs the 4-bit kernel.

Q5_1/Q5_K (levels to 31 with minimums) fit neither and are expanded to float (recorded in
``model.quantization["float_layers"]``). The layer's ``dequantize()`` equals the GGUF
reader's values exactly (scales and minimums are the float32 numbers ggml computes).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnlab.functional.gguf_blocks import GGMLType, QuantBlocks, block_layout, split_blocks
from attnlab.interop.gguf_names import gguf_name, unpermute_qk
from attnlab.interop.gguf_reader import GGUFFile
from attnlab.modules.linear import LinearSpec
from attnlab.modules.quant_linear import Int4Linear, Int8Linear, QuantEmbedding, QuantLinear

__all__ = ["blocks_to_keep", "fits_layer", "layer_from_blocks", "load_blocks", "place_blocks"]

_CENTRED4 = {GGMLType.Q4_0}  # signed 4-bit levels: shifted into 0..15 with min = -8 scale


def fits_layer(kind: GGMLType, in_features: int) -> bool:
    """Whether a ``kind`` tensor with rows of ``in_features`` maps onto a quantized layer."""
    lay = block_layout(kind)
    if not lay.quantized or in_features % lay.group_size:
        return False
    if kind in _CENTRED4:
        return True
    return (lay.has_mins and lay.bits <= 4) or (not lay.has_mins and lay.bits <= 8)


def layer_from_blocks(
    blocks: QuantBlocks,
    shape: tuple[int, int],
    *,
    row_order: Tensor | None = None,
    kernel: str = "auto",
    compute: str = "auto",
) -> QuantLinear:
    """The quantized layer holding ``blocks`` of a ``[N, K]`` weight (no bias).

    Args:
        blocks: the tensor's unpacked blocks (groups in element order).
        shape: ``(N, K)`` in torch order.
        row_order: a permutation of the ``N`` rows to apply (llama.cpp's q/k order undone).
        kernel: the layer's kernel (``"auto"``).
        compute: the layer's compute-dtype policy.

    Raises:
        ValueError: a format no layer holds exactly (see :func:`fits_layer`).
    """
    n, k = shape
    if not fits_layer(blocks.kind, k):
        raise ValueError(f"{blocks.kind.name} rows of {k} do not map onto an int8 or int4 layer")
    e = blocks.group_size
    q = blocks.quants.reshape(n, k)  # [N, K] int8 levels
    scales = blocks.scales.reshape(n, k // e)
    mins = None if blocks.mins is None else blocks.mins.reshape(n, k // e)
    if row_order is not None:
        q, scales = q[row_order], scales[row_order]
        mins = None if mins is None else mins[row_order]
    layer: QuantLinear
    if blocks.kind in _CENTRED4:  # d * q, q in -8..7  ==  d * (q + 8) + (-8 d)
        layer = Int4Linear(
            in_features=k, out_features=n, group_size=e, kernel=kernel, compute=compute
        )
        layer.set_weights((q.to(torch.int16) + 8).to(torch.uint8), scales, -8.0 * scales)
    elif mins is not None:
        layer = Int4Linear(
            in_features=k, out_features=n, group_size=e, kernel=kernel, compute=compute
        )
        layer.set_weights(q.to(torch.uint8), scales, mins)
    else:
        layer = Int8Linear(
            in_features=k, out_features=n, group_size=e, kernel=kernel, compute=compute
        )
        layer.set_weights(q, scales)
    return layer


def place_blocks(model: nn.Module, name: str, layer: QuantLinear) -> None:
    """Put ``layer`` where parameter ``name`` (``layers.3.self_attention.q_proj.weight``,
    ``embed_tokens.weight``, ``lm_head.weight``) lives: a linear layer is replaced, an
    embedding becomes a :class:`QuantEmbedding` (also the LM head when tied)."""
    path, _, leaf = name.rpartition(".")
    assert leaf == "weight", name
    parent_path, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    old = getattr(parent, child)
    if isinstance(old, nn.Embedding):
        setattr(parent, child, QuantEmbedding(table=layer))
        return
    if not isinstance(old, nn.Linear):
        raise TypeError(f"{name}: expected a linear layer or embedding, found {type(old).__name__}")
    if old.bias is not None:
        layer.bias = nn.Parameter(old.bias.detach().clone())
    setattr(parent, child, layer)


def blocks_to_keep(gguf: GGUFFile) -> set[str]:
    """The GGUF tensors a quantized load keeps as blocks: 2-D quantized weights whose
    format maps onto a layer (the others are expanded to float as usual)."""
    return {
        name
        for name, info in gguf.tensors.items()
        if len(info.shape) == 2 and fits_layer(info.kind, info.shape[1])
    }


def load_blocks(
    model: nn.Module,
    gguf: GGUFFile,
    kept: set[str],
    heads: dict[str, int],
    quantize: str,
) -> nn.Module:
    """Replace ``model``'s placeholder weights by the quantized layers of ``kept`` tensors,
    then quantize the remaining float linear layers when ``quantize`` names a spec.

    Args:
        model: built by the loader, with meta placeholders where ``kept`` tensors go.
        gguf: the open file.
        kept: GGUF names from :func:`blocks_to_keep`.
        heads: ``{"attn_q": query heads, "attn_k": key/value heads}`` (row order).
        quantize: ``"gguf"`` (keep the file's blocks, leave the rest float) or a
            :class:`~attnlab.modules.linear.LinearSpec` string for the float tensors.
    """
    from attnlab.interop import llama
    from attnlab.models.quantize import quantize_model

    spec = None if quantize == "gguf" else LinearSpec.parse(quantize)
    kernel, compute = (spec.kernel, spec.compute) if spec is not None else ("auto", "auto")
    counts: dict[str, int] = {}
    for ours, theirs in llama.LLAMA.key_map(model).items():
        gname = gguf_name(theirs) if theirs != "model.embed_tokens.weight" else "token_embd.weight"
        if gname is None or gname not in kept:
            continue
        info = gguf.tensors[gname]
        part = gname.split(".")[2] if gname.startswith("blk.") else ""
        order = unpermute_qk(torch.arange(info.shape[0]), heads[part]) if part in heads else None
        blocks = split_blocks(gguf.raw(gname), info.kind)
        layer = layer_from_blocks(
            blocks, (info.shape[0], info.shape[1]), row_order=order, kernel=kernel, compute=compute
        )
        place_blocks(model, ours, layer)
        counts[info.kind.name] = counts.get(info.kind.name, 0) + 1
    floats: list[str] = []
    if spec is not None and spec.quantized:
        quantize_model(model, spec)
        floats = list(getattr(model, "quantization", {}).get("float_layers", []))
    else:
        floats = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    model.quantization = {  # type: ignore[assignment]
        "weights": quantize,
        "group_size": spec.effective_group if spec is not None else None,
        "from_gguf": counts,
        "float_layers": floats,
    }
    return model
