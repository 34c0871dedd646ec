"""The cost model on MoE configs: parameters (total, active), FLOPs, all-to-all bytes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from attnlab.analysis.arch import MoESpec, describe
from attnlab.analysis.cost import estimate
from attnlab.analysis.moe_cost import all_to_all_bytes, moe_layer_flops, routed_expert_flops
from attnlab.functional.expert_dispatch import moe_reference
from attnlab.functional.routing import token_choice
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.layout import LayerSpec, MoEConfig

SMALL: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
)


def test_mixtral_8x7b_total_and_active_parameters() -> None:
    # Jiang et al. (2024): 46.7 B parameters, 12.9 B active per token
    c = DecoderConfig.mixtral(
        moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=14336),
        vocab_size=32000,
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
    )
    r = estimate(c, seq_len=16)
    assert round(r.parameter_count / 1e9, 1) == 46.7
    assert round(r.active_parameter_count / 1e9, 1) == 12.9
    assert "active parameters per token" in r.summary()


@pytest.mark.parametrize(
    "overrides",
    [
        dict(
            layers=(
                LayerSpec(ffn="moe", moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=24)),
            )
            * 3
        ),
        dict(
            attention_bias=True,
            attention_out_bias=False,
            layers=(
                LayerSpec(),
                LayerSpec(
                    ffn="moe",
                    moe=MoEConfig(
                        num_experts=4,
                        top_k=1,
                        intermediate_size=16,
                        shared_expert_intermediate_size=40,
                        shared_expert_gate=True,
                    ),
                ),
                LayerSpec(),
            ),
        ),
        dict(
            qk_norm=True,
            layers=(
                LayerSpec(
                    ffn="moe",
                    moe=MoEConfig(
                        num_experts=3,
                        top_k=2,
                        intermediate_size=8,
                        expert_mlp="standard",
                        hidden_act="gelu",
                    ),
                ),
            )
            * 3,
        ),
    ],
)
def test_parameter_count_equals_the_built_model(overrides: dict[str, Any]) -> None:
    c = DecoderConfig(**(SMALL | overrides))
    model = DecoderLM(c)
    r = estimate(c, seq_len=8)
    assert r.parameter_count == model.num_parameters()
    # active: routed experts beyond top-k are idle
    idle = sum(
        p.numel() * (1 - layer.feed_forward.router.top_k / layer.feed_forward.router.num_experts)
        for layer in model.layers
        if hasattr(layer.feed_forward, "experts")
        for p in layer.feed_forward.experts.parameters()
    )
    assert r.active_parameter_count == model.num_parameters() - round(idle)


def test_feed_forward_flops_of_an_all_moe_model() -> None:
    moe = MoEConfig(num_experts=4, top_k=2, intermediate_size=24, shared_expert_intermediate_size=8)
    c = DecoderConfig(**(SMALL | dict(layers=(LayerSpec(ffn="moe", moe=moe),) * 3)))
    spec = describe(c)
    assert spec.moe is not None and spec.moe.num_layers == 3
    r = estimate(c, seq_len=10, batch_size=2)
    mm, _ = moe_layer_flops(20, 32, spec.moe)
    assert r.by_component["feed_forward"].matmul_flops == pytest.approx(3 * mm)
    # router 2*T*D*E + routed 2*T*k*D*F*3 + shared 2*T*D*F_s*3
    assert mm == 2 * 20 * 32 * 4 + 2 * 20 * 2 * 32 * 24 * 3 + 2 * 20 * 32 * 8 * 3


def test_routed_expert_flops_equal_flop_counter_on_the_reference_loop() -> None:
    g = torch.Generator().manual_seed(0)
    x, w_in, w_out = (
        torch.randn(12, 16, generator=g),
        torch.randn(4, 40, 16),
        torch.randn(4, 16, 20),
    )
    routing = token_choice(torch.randn(12, 4, generator=g), 2)
    with FlopCounterMode(display=False) as counter:
        moe_reference(x, routing, w_in, w_out, activation=F.silu, gated=True)
    spec = MoESpec(num_layers=1, num_experts=4, top_k=2, intermediate_size=20)
    assert routed_expert_flops(12 * 2, 16, spec) == counter.get_total_flops()


def test_all_to_all_bytes() -> None:
    spec = MoESpec(num_layers=2, num_experts=8, top_k=2, intermediate_size=64)
    assert all_to_all_bytes(100, 32, spec, parallel=1, bytes_per_element=4) == 0
    # 2 (dispatch + combine) * T * k * D * (P-1)/P * bytes * layers
    assert (
        all_to_all_bytes(100, 32, spec, parallel=4, bytes_per_element=2)
        == 2 * 100 * 2 * 32 * 0.75 * 2 * 2
    )
    assert (
        all_to_all_bytes(100, 32, spec, parallel=4, bytes_per_element=2, backward=True)
        == 2 * 2 * 100 * 2 * 32 * 0.75 * 2 * 2
    )
    c = DecoderConfig.mixtral(moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=24), **SMALL)
    r = estimate(c, seq_len=10, expert_parallel=4)
    assert r.all_to_all_bytes == all_to_all_bytes(
        10, 32, describe(c).moe, parallel=4, bytes_per_element=4
    )  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expert_parallel must be a positive int"):
        estimate(c, seq_len=10, expert_parallel=0)
