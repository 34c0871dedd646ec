"""Quantized MoE experts: each expert's matrices as int8/int4 layers, equal to the float64
MoE of the dequantized weights, in a whole Mixtral-style model through quantize_model."""

from __future__ import annotations

import pytest
import torch

from attnlab.functional.expert_dispatch import moe_reference
from attnlab.functional.routing import route
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.layout import MoEConfig
from attnlab.models.quantize import quantize_model
from attnlab.modules.experts import Experts
from attnlab.modules.quant_experts import QuantExperts


@pytest.mark.parametrize("spec", ["int8:g32", "int4:g32"])
@pytest.mark.parametrize("gated", [True, False])
def test_quantized_experts_equal_the_float64_moe_of_their_weights(spec: str, gated: bool) -> None:
    torch.manual_seed(0)
    experts = Experts(num_experts=4, embed_dim=64, hidden_dim=32, gated=gated)
    q = QuantExperts.from_float(experts, spec)
    for layer in [*q.w_in, *q.w_out]:
        layer.compute = "float32"  # float32 products: the reference's rounding, not bf16's
    x = torch.randn(10, 64)
    routing = route(torch.randn(10, 4), 2, router="softmax_topk", normalize=True)
    got, dropped = q(x, routing)
    w_in, w_out = q.dequantized()
    want = moe_reference(
        x.double(), routing._replace(weights=routing.weights.double()), w_in.double(),
        w_out.double(), activation=q.act, gated=gated,
    )  # fmt: skip
    assert dropped is None
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    ref_out, _ = q(x, routing, dispatch="reference")
    torch.testing.assert_close(ref_out, got)
    with pytest.raises(ValueError, match="dispatch='capacity'"):
        q(x, routing, dispatch="capacity", capacity=4)
    # the quantization error itself is small: int8 close to the float experts
    if spec.startswith("int8"):
        flt, _ = experts(x, routing)
        assert float((got - flt).norm() / flt.norm()) < 0.02


def test_quantize_model_quantizes_the_experts_of_a_moe_model() -> None:
    torch.manual_seed(0)
    config = DecoderConfig.mixtral(
        moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=64),
        vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = DecoderLM(config).eval()
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        quantize_model(model, "int8:g32")
        got = model(ids).logits
    kinds = {type(m).__name__ for m in model.modules()}
    assert "QuantExperts" in kinds and "Experts" not in kinds
    assert float((got - ref).norm() / ref.norm()) < 0.05
    assert torch.equal(model.generate(ids, 4)[:, :12], ids)
    kept = quantize_model(
        DecoderLM(DecoderConfig.mixtral(
            moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=48),
            vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64,
        )),
        "int4:g32",
    ).quantization["float_layers"]  # fmt: skip
    assert any(name.endswith("experts") for name in kept)  # F = 48: not groups of 32


def test_a_quantized_moe_model_saves_and_reloads_as_stored(tmp_path: object) -> None:
    from pathlib import Path

    from attnlab.interop.quantized import load_quantized, save_quantized

    torch.manual_seed(0)
    config = DecoderConfig.mixtral(
        moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=64),
        vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = quantize_model(DecoderLM(config).eval(), "int4")
    save_quantized(model, Path(str(tmp_path)) / "moe")
    back = load_quantized(Path(str(tmp_path)) / "moe")
    ids = torch.tensor([[1, 2, 3, 40]])
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
