"""GGUF quantized blocks repacked into int8/int4 layers without float: exact values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from attnlab.functional.gguf_blocks import dequantize, split_blocks
from attnlab.interop.gguf_quant import fits_layer, layer_from_blocks
from attnlab.models.quantize import quantized_layers, set_compute
from attnlab.modules.quant_linear import Int4Linear, Int8Linear, QuantEmbedding

gguf = pytest.importorskip("gguf")


@pytest.mark.parametrize(
    "kind,layer", [("Q8_0", Int8Linear), ("Q4_0", Int4Linear), ("Q4_1", Int4Linear)]
)
def test_blocks_repack_exactly(kind: str, layer: type) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 128)).astype(np.float32)
    raw = torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind]).copy())
    raw = raw.reshape(-1)
    values = dequantize(raw, kind, (32, 128))
    # and gguf's own dequantizer agrees with the block module
    ref = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[kind]).reshape(32, 128)
    torch.testing.assert_close(values, torch.from_numpy(ref), rtol=0, atol=0)
    order = torch.randperm(32)
    q = layer_from_blocks(split_blocks(raw, kind), (32, 128), row_order=order, compute="float32")
    assert isinstance(q, layer) and q.group_size == 32
    torch.testing.assert_close(q.dequantize(), values[order], rtol=0, atol=0)
    x = torch.randn(3, 128)
    torch.testing.assert_close(q(x), x @ values[order].T, rtol=1e-5, atol=1e-4)


def test_formats_that_fit_no_layer_are_named() -> None:
    from attnlab.functional.gguf_blocks import GGMLType

    assert fits_layer(GGMLType.Q6_K, 256) and fits_layer(GGMLType.Q4_K, 256)
    assert not fits_layer(GGMLType.Q5_1, 64) and not fits_layer(GGMLType.F16, 64)
    assert not fits_layer(GGMLType.Q8_0, 48)  # rows not a whole number of blocks


def test_smollm2_loads_quantized_as_stored(smollm2_file: Path, smollm2: torch.nn.Module) -> None:
    import attnlab

    q = attnlab.from_gguf(smollm2_file, quantize="gguf", tokenizer=False)
    assert q.quantization["from_gguf"] == {"Q4_1": 210, "Q8_0": 1}
    assert q.quantization["float_layers"] == []
    assert isinstance(q.embed_tokens, QuantEmbedding)
    floats = smollm2.state_dict()
    for name, layer in quantized_layers(q).items():
        key = name.replace("embed_tokens.table", "embed_tokens") + ".weight"
        assert torch.equal(layer.dequantize(), floats[key]), name
    # a quantized load multiplies int8 activation blocks by default, as llama.cpp does
    assert {layer.compute for layer in quantized_layers(q).values()} == {"int8"}
    ids = torch.tensor([[504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30]])
    with torch.no_grad():
        a, b = smollm2(ids).logits, q(ids).logits
        set_compute(q, "auto")
        c = q(ids).logits
    # same weights; only the activations' rounding differs (int8 blocks of 32, or
    # bfloat16 where the CPU multiplies it natively)
    for got in (b, c):
        assert float((a - got).norm() / a.norm()) < 0.05
        assert (a.argmax(-1) == got.argmax(-1)).float().mean() >= 0.8
