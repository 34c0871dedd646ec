"""``to_gguf`` writes quantized layers from their levels: Q8_0, Q4_0, Q4_1 blocks that the
``gguf`` package's reader and attnlab's own read back exactly."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

import attnlab
from attnlab.interop.gguf_names import unpermute_qk
from attnlab.interop.gguf_writer import layer_block_type
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.quantize import quantize_model, quantized_layers, set_compute

gguf = pytest.importorskip("gguf")

IDS = torch.tensor([[1, 5, 9, 77, 3, 120, 64, 2, 31, 8]])


def _llama() -> DecoderLM:
    torch.manual_seed(0)
    config = DecoderConfig.llama(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
    )  # fmt: skip
    return DecoderLM(config).eval()


def _f16_exact(model: DecoderLM) -> DecoderLM:
    """Scales and minimums rounded to float16 in place: what a GGUF block can hold."""
    for layer in quantized_layers(model).values():
        for name in ("scales", "mins"):
            if hasattr(layer, name):
                t = getattr(layer, name)
                t.copy_(t.to(torch.float16).to(torch.float32))
    return model


def _read(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (type, values) through the gguf package's reader and dequantizer."""
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        kind = gguf.GGMLQuantizationType(t.tensor_type)
        out[t.name] = (kind.name, gguf.quants.dequantize(t.data, kind))
    return out


@pytest.mark.parametrize(("spec", "block"), [("int8:g32", "Q8_0"), ("int4", "Q4_1")])
def test_quantized_layers_round_trip_through_gguf(tmp_path: Path, spec: str, block: str) -> None:
    model = _f16_exact(quantize_model(_llama(), spec))
    path = attnlab.to_gguf(model, tmp_path / "q.gguf")
    read = _read(path)
    layers = quantized_layers(model)
    # the gguf package's dequantization of every matrix equals the layer's own values
    down = read["blk.1.ffn_down.weight"]
    assert down[0] == block
    ref = layers["layers.1.feed_forward.down_proj"].dequantize()
    np.testing.assert_array_equal(down[1].reshape(ref.shape), ref.numpy())
    q = read["blk.0.attn_q.weight"]
    ref = layers["layers.0.self_attention.q_proj"].dequantize()
    got = unpermute_qk(torch.from_numpy(q[1].reshape(ref.shape).copy()), 4)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert read["token_embd.weight"][0] == block
    assert read["blk.0.attn_norm.weight"][0] == "F32"
    meta = gguf.GGUFReader(str(path)).fields["general.file_type"]
    assert int(meta.parts[-1][0]) == {"Q8_0": 7, "Q4_1": 3}[block]
    # attnlab's reader keeps the blocks as layers: the same levels, the same logits (with
    # the model's float activations asked for: int8 blocks are a quantized load's default)
    back = attnlab.from_gguf(path, quantize="gguf", tokenizer=False, compute="auto")
    for name, layer in quantized_layers(back).items():
        mine = layers[name]
        assert torch.equal(layer.qweight, mine.qweight), name
        assert torch.equal(layer.scales, mine.scales), name
    with torch.no_grad():
        torch.testing.assert_close(back(IDS).logits, model(IDS).logits, rtol=0, atol=0)
    default = attnlab.from_gguf(path, quantize="gguf", tokenizer=False)
    assert {layer.compute for layer in quantized_layers(default).values()} == {"int8"}
    set_compute(model, "int8")
    with torch.no_grad():
        torch.testing.assert_close(default(IDS).logits, model(IDS).logits, rtol=0, atol=0)


def test_q4_0_blocks_are_written_back_byte_for_byte(tmp_path: Path) -> None:
    """Q4_0 made by gguf.quants, read into int4 layers (minimum -8 d), written again."""
    first = attnlab.to_gguf(_llama(), tmp_path / "a.gguf", dtype="q4_0")
    model = attnlab.from_gguf(first, quantize="gguf", tokenizer=False)
    assert {layer_block_type(m) for m in quantized_layers(model).values()} == {"Q4_0"}
    second = attnlab.to_gguf(model, tmp_path / "b.gguf")
    a = {t.name: t for t in gguf.GGUFReader(str(first)).tensors}
    for t in gguf.GGUFReader(str(second)).tensors:
        assert t.tensor_type == a[t.name].tensor_type, t.name
        assert np.array_equal(np.asarray(t.data), np.asarray(a[t.name].data)), t.name
    # a Q4_0 layer is also exactly a Q4_1 block (minimum -8 d)
    third = attnlab.to_gguf(model, tmp_path / "c.gguf", dtype="q4_1")
    assert _read(third)["blk.0.ffn_up.weight"][0] == "Q4_1"


def test_layers_no_block_holds_are_refused(tmp_path: Path) -> None:
    per_channel = quantize_model(_llama(), "int8")
    with pytest.raises(ValueError, match="no GGUF block type holds it exactly"):
        attnlab.to_gguf(per_channel, tmp_path / "x.gguf")
    g32 = quantize_model(_llama(), "int8:g32")
    with pytest.raises(ValueError, match="GGUF Q8_0.*would round it again"):
        attnlab.to_gguf(g32, tmp_path / "x.gguf", dtype="q4_0")
    assert not list(tmp_path.iterdir())
    # f32: the layers' values, dequantized exactly
    path = attnlab.to_gguf(copy.deepcopy(g32), tmp_path / "f.gguf", dtype="f32")
    flat = attnlab.from_gguf(path, tokenizer=False)
    for name, layer in quantized_layers(g32).items():
        if not name.startswith("embed_tokens"):
            assert torch.equal(flat.get_submodule(name).weight, layer.dequantize()), name


def test_compute_needs_quantize_and_a_known_policy(tmp_path: Path) -> None:
    path = attnlab.to_gguf(quantize_model(_llama(), "int8:g32"), tmp_path / "q.gguf")
    with pytest.raises(ValueError, match="pass quantize= too"):
        attnlab.from_gguf(path, tokenizer=False, compute="int8")
    with pytest.raises(ValueError, match="compute must be None or one of"):
        attnlab.from_gguf(path, quantize="gguf", tokenizer=False, compute="fp8")
    floats = attnlab.from_gguf(path, quantize="gguf", tokenizer=False, compute="float32")
    assert {layer.compute for layer in quantized_layers(floats).values()} == {"float32"}
