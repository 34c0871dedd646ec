"""Quantized linear layers: every kernel against a float64 dequantize-then-multiply, the
factory, and a whole model quantized through it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from attnlab.backends.qmatmul import KERNELS, compute_dtype, explain_linear, use_kernel
from attnlab.functional.quant import (
    dequantize_int4,
    dequantize_int8,
    pack_nibbles,
    quantize_int4,
    quantize_int8,
    quantized_linear_reference,
    unpack_nibbles,
)
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.quantize import kernel_report, quantize_model, quantized_layers
from attnlab.modules.linear import LinearSpec, convert_linear, make_linear
from attnlab.modules.quant_linear import Int4Linear, Int8Linear, QuantEmbedding


def _linear(k: int = 64, n: int = 32, bias: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(k, n, bias=bias)


def _skip_without(kernel: str) -> None:
    from attnlab.backends.qmatmul_cpu import unavailable

    why = unavailable() if kernel == "fused" else None
    if why is not None:  # a machine without a C compiler: the kernel is not offered
        pytest.skip(why)


def test_int8_rounding_is_within_half_a_step() -> None:
    w = torch.randn(16, 64)
    for g in (None, 32):
        q, s = quantize_int8(w, g)
        err = (dequantize_int8(q, s) - w).abs().reshape(16, s.shape[1], -1)
        assert bool((err <= s[..., None] / 2 + 1e-7).all())
        assert q.dtype == torch.int8 and int(q.abs().max()) <= 127


def test_int4_rounding_and_nibble_packing() -> None:
    w = torch.randn(16, 64)
    levels, s, m = quantize_int4(w, 32)
    assert int(levels.max()) <= 15
    err = (dequantize_int4(levels, s, m) - w).abs().reshape(16, 2, 32)
    assert bool((err <= s[..., None] / 2 + 1e-6).all())
    packed = pack_nibbles(levels)
    assert packed.shape == (16, 32) and torch.equal(unpack_nibbles(packed), levels)
    assert int(packed[0, 0]) == int(levels[0, 0]) | (int(levels[0, 1]) << 4)


@pytest.mark.parametrize(
    "layer_kind,group,kernel",
    [
        ("int8", None, "int8pack"),
        ("int8", None, "dequant"),
        ("int8", 32, "dequant"),
        ("int8", 32, "int8groups"),
        ("int4", 32, "int4pack"),
        ("int4", 64, "int4pack"),
        ("int4", 32, "dequant"),
        ("int8", None, "fused"),
        ("int8", 32, "fused"),
        ("int4", 32, "fused"),
        ("int4", 64, "fused"),
    ],
)
def test_kernels_match_the_float64_reference(
    layer_kind: str, group: int | None, kernel: str
) -> None:
    _skip_without(kernel)
    lin = _linear()
    spec = LinearSpec(layer_kind, group, kernel=kernel, compute="float32")
    layer = convert_linear(lin, spec)
    assert isinstance(layer, Int8Linear | Int4Linear)
    x = torch.randn(3, 5, 64)
    y = layer(x).detach()
    assert layer.last_choice is not None and layer.last_choice.chosen == kernel
    mins = layer.mins if isinstance(layer, Int4Linear) else None
    q = layer.levels() if isinstance(layer, Int4Linear) else layer.qweight
    ref = quantized_linear_reference(x, q, layer.scales, mins, layer.bias.detach())
    # float32 rounding: error relative to sum |x| |w|
    bound = (x.abs().double() @ layer.dequantize(torch.float64).abs().T).max() * 2e-6
    assert y.shape == (3, 5, 32) and y.dtype == torch.float32
    assert float((y.double() - ref).abs().max()) <= float(bound)


@pytest.mark.parametrize("kernel", ["int8pack", "int4pack", "dequant", "fused"])
def test_bfloat16_compute_is_within_bfloat16_rounding(kernel: str) -> None:
    _skip_without(kernel)
    kind = "int4" if kernel in ("int4pack", "fused") else "int8"
    layer = convert_linear(_linear(bias=False), LinearSpec(kind, kernel=kernel, compute="bfloat16"))
    x = torch.randn(4, 64)
    ref = x.double() @ layer.dequantize(torch.float64).T
    y = layer(x)
    assert y.dtype == torch.float32
    scale = (x.abs().double() @ layer.dequantize(torch.float64).abs().T).max()
    assert float((y.double() - ref).abs().max()) <= float(scale) * 2e-2


def test_auto_measures_and_explains() -> None:
    layer = convert_linear(_linear(), "int4")
    choice = explain_linear(layer, rows=1)
    assert choice.how == "measured" and choice.chosen in choice.timings_us
    assert set(choice.timings_us) | set(choice.rejected) == set(KERNELS)
    assert "int8" in choice.rejected["int8pack"]
    assert str(choice).startswith(choice.chosen)
    with use_kernel("dequant"):
        layer(torch.randn(2, 64))
    assert layer.last_choice is not None and layer.last_choice.how == "forced"


def test_compute_dtype_policy() -> None:
    assert compute_dtype(torch.float32, "float32")[0] == torch.float32
    assert compute_dtype(torch.float64, "auto")[0] == torch.float64
    dt, why = compute_dtype(torch.float32, "auto")
    assert dt in (torch.float32, torch.bfloat16) and why
    with pytest.raises(ValueError, match="compute must be one of"):
        compute_dtype(torch.float32, "fp8")


def test_factory_float_is_a_plain_linear() -> None:
    lin = make_linear(8, 4, bias=False)
    assert type(lin) is nn.Linear and lin.bias is None
    assert isinstance(make_linear(64, 16, spec="int4:g64"), Int4Linear)
    assert isinstance(make_linear(64, 16, spec="int8"), Int8Linear)


@pytest.mark.parametrize(
    "bad,match",
    [
        ("int3", "quantize must be"),
        ("int4:64", "':g<size>'"),
        (LinearSpec("float"), "no quantization"),
    ],
)
def test_bad_specs_are_refused(bad: object, match: str) -> None:
    model = DecoderLM(
        DecoderConfig(
            vocab_size=32,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
        )
    )
    with pytest.raises(ValueError, match=match):
        quantize_model(model, bad)  # type: ignore[arg-type]


def test_layer_errors_name_the_values() -> None:
    with pytest.raises(ValueError, match=r"group_size \(48\) must divide in_features \(64\)"):
        Int4Linear(in_features=64, out_features=16, group_size=48)
    with pytest.raises(ValueError, match="kernel must be"):
        LinearSpec("int8", kernel="fast")
    layer = Int4Linear(in_features=64, out_features=16)
    with pytest.raises(ValueError, match="0..15"):
        layer.set_weights(torch.full((16, 64), 16), torch.ones(16, 2), torch.zeros(16, 2))
    with pytest.raises(ValueError, match="cannot run this layer"):
        convert_linear(_linear(k=64, n=8), LinearSpec("int4", kernel="int4pack"))(
            torch.randn(1, 64)
        )
    with pytest.raises(ValueError, match="round twice"):
        convert_linear(convert_linear(_linear(), "int8"), "int4")


def _tiny(tied: bool = True) -> DecoderLM:
    torch.manual_seed(0)
    cfg = DecoderConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        tie_word_embeddings=tied,
    )
    return DecoderLM(cfg).eval()


@pytest.mark.parametrize("quant,tol", [("int8", 0.02), ("int8:g32", 0.02), ("int4", 0.25)])
@pytest.mark.parametrize("tied", [True, False])
def test_quantized_model_is_close_and_generates(quant: str, tol: float, tied: bool) -> None:
    model = _tiny(tied)
    ids = torch.randint(0, 128, (2, 9))
    ref = model(ids).logits
    q = quantize_model(copy.deepcopy(model), quant)
    out = q(ids).logits
    rel = float((out - ref).norm() / ref.norm())
    assert rel < tol, rel
    assert isinstance(q.embed_tokens, QuantEmbedding)
    assert len(quantized_layers(q)) == 2 * 7 + 1 + (0 if tied else 1)
    # every layer multiplied once (an untied embedding table is only looked up)
    ran = sum(kernel_report(q)["kernels"].values())
    assert ran == len(quantized_layers(q)) - (0 if tied else 1)
    gen = q.generate(ids[:1], 4)
    assert gen.shape == (1, 13)
    assert q.quantization["weights"] == quant.split(":")[0]


def test_quantized_state_dict_round_trips() -> None:
    q = quantize_model(_tiny(), "int4:g64")
    fresh = quantize_model(_tiny(), "int4:g64")
    for layer in quantized_layers(fresh).values():
        layer.qweight.zero_()
    fresh.load_state_dict(q.state_dict())
    ids = torch.randint(0, 128, (1, 6))
    torch.testing.assert_close(fresh(ids).logits, q(ids).logits, rtol=0, atol=0)


def test_layers_whose_width_does_not_fit_the_group_stay_float() -> None:
    q = quantize_model(_tiny(), "int4:g128")  # hidden 64: only down_proj (K=128) fits
    assert "embed_tokens" in q.quantization["float_layers"]
    assert isinstance(q.layers[0].feed_forward.down_proj, Int4Linear)
    assert type(q.layers[0].feed_forward.up_proj) is nn.Linear


@pytest.mark.parametrize("quant", ["int8", "int4:g32"])
def test_save_and_reload_computes_the_same(quant: str, tmp_path: object) -> None:
    from pathlib import Path

    from attnlab.interop.quantized import load_quantized, save_quantized

    q = quantize_model(_tiny(), quant)
    folder = save_quantized(q, Path(str(tmp_path)) / "m")
    back = load_quantized(folder)
    ids = torch.randint(0, 128, (1, 7))
    torch.testing.assert_close(back(ids).logits, q(ids).logits, rtol=0, atol=0)
    assert back.quantization == q.quantization
    assert isinstance(back.embed_tokens, QuantEmbedding)
