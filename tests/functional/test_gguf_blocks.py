"""GGUF block layouts against the ``gguf`` package (ggml's own Python implementation)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnlab.functional import gguf_blocks as gb

gguf = pytest.importorskip("gguf")

QUANTIZED = [t for t in gb.GGMLType if gb.block_layout(t).quantized]
# byte offsets of each block's float16 fields (scales, minimums), per ggml-common.h
_F16_FIELDS = {
    "Q8_0": [0],
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
}
# the stored levels' range: [low, high]
_LEVELS = {
    "Q8_0": (-128, 127),
    "Q4_0": (-8, 7),
    "Q4_1": (0, 15),
    "Q5_0": (-16, 15),
    "Q5_1": (0, 31),
    "Q2_K": (0, 3),
    "Q3_K": (-4, 3),
    "Q4_K": (0, 15),
    "Q5_K": (0, 31),
    "Q6_K": (-32, 31),
}


def _random_blocks(kind: gb.GGMLType, n: int, seed: int = 0) -> np.ndarray:
    """Random bytes (any bytes are valid levels) with finite float16 scale fields."""
    lay = gb.block_layout(kind)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, lay.type_size), dtype=np.uint8)
    for off in _F16_FIELDS[kind.name]:
        raw[:, off : off + 2] = rng.normal(size=(n, 1)).astype(np.float16).view(np.uint8)
    return raw


def test_layouts_match_the_gguf_package() -> None:
    for t in gb.GGMLType:
        lay = gb.block_layout(t)
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(t))] == (
            lay.block_size,
            lay.type_size,
        ), t.name
        assert gb.tensor_nbytes(t, 4 * 256) == 4 * 256 // lay.block_size * lay.type_size


@pytest.mark.parametrize("kind", QUANTIZED, ids=lambda t: t.name)
def test_dequantize_equals_ggml_reference(kind: gb.GGMLType) -> None:
    raw = _random_blocks(kind, 48)
    ref = gguf.quants.dequantize(raw.reshape(-1), gguf.GGMLQuantizationType(int(kind)))
    ours = gb.dequantize(torch.from_numpy(raw.copy()), kind)
    np.testing.assert_array_equal(ours.numpy(), ref.reshape(-1))


@pytest.mark.parametrize("kind", QUANTIZED, ids=lambda t: t.name)
def test_split_blocks_levels_and_affine_form(kind: gb.GGMLType) -> None:
    lay = gb.block_layout(kind)
    raw = torch.from_numpy(_random_blocks(kind, 16, seed=1).copy())
    blocks = gb.split_blocks(raw, kind.name.lower())
    groups = 16 * lay.block_size // lay.group_size
    assert blocks.quants.shape == (groups, lay.group_size)
    assert blocks.quants.dtype == torch.int8
    assert blocks.scales.shape == (groups,)
    assert (blocks.mins is not None) == lay.has_mins
    lo, hi = _LEVELS[kind.name]
    assert int(blocks.quants.min()) >= lo and int(blocks.quants.max()) <= hi
    # random bytes reach every level of a 256-element block's range
    assert int(blocks.quants.min()) == lo and int(blocks.quants.max()) == hi
    value = blocks.scales[:, None] * blocks.quants.float()
    if blocks.mins is not None:
        value = value + blocks.mins[:, None]
    torch.testing.assert_close(value.reshape(-1), gb.dequantize(raw, kind), rtol=0, atol=0)


def test_quantized_round_trip_through_the_gguf_quantizer() -> None:
    x = torch.randn(8, 64)
    for kind in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        qt = gguf.GGMLQuantizationType[kind]
        packed = torch.from_numpy(gguf.quants.quantize(x.numpy(), qt))
        back = gb.dequantize(packed, kind, (8, 64))
        step = x.abs().max() / (2 ** (gb.block_layout(kind).bits - 1))
        assert (back - x).abs().max() <= step


@pytest.mark.parametrize(
    ("kind", "dtype"), [("F32", torch.float32), ("F16", torch.float16), ("BF16", torch.bfloat16)]
)
def test_float_types(kind: str, dtype: torch.dtype) -> None:
    x = torch.randn(3, 5).to(dtype)
    raw = x.contiguous().view(torch.uint8).reshape(-1)
    torch.testing.assert_close(gb.dequantize(raw, kind, (3, 5), dtype), x, rtol=0, atol=0)
    torch.testing.assert_close(gb.dequantize(raw, kind, (3, 5)), x.float(), rtol=0, atol=0)


def test_errors_name_the_values() -> None:
    with pytest.raises(ValueError, match=r"ggml type 'Q9_9' is not supported.*Q4_K \(12\)"):
        gb.ggml_type("Q9_9")
    with pytest.raises(ValueError, match=r"ggml type 99 is not supported"):
        gb.block_layout(99)
    with pytest.raises(ValueError, match="Q4_1 blocks are 20 bytes; got 30 bytes"):
        gb.dequantize(torch.zeros(30, dtype=torch.uint8), "Q4_1")
    with pytest.raises(TypeError, match="uint8 tensor"):
        gb.split_blocks(torch.zeros(20), "Q4_1")
    with pytest.raises(ValueError, match="F16 stores plain values"):
        gb.split_blocks(torch.zeros(20, dtype=torch.uint8), "F16")
    with pytest.raises(ValueError, match=r"hold 32 values, not the 64 of shape \(8, 8\)"):
        gb.dequantize(torch.zeros(34, dtype=torch.uint8), "Q8_0", (8, 8))
    with pytest.raises(ValueError, match="whole blocks of 256 elements; got 100"):
        gb.tensor_nbytes("Q6_K", 100)
