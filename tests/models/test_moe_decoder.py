"""The decoder's per-layer layout, MoE layers, router outputs and cached decoding."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from attnlab.functional.routing import load_balancing_loss, router_z_loss
from attnlab.models import mixers
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.layout import LayerSpec, MoEConfig
from attnlab.modules.mlp import GatedFeedForward
from attnlab.modules.moe import MoEBlock

SMALL: dict[str, Any] = dict(
    vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48
)
MOE = MoEConfig(num_experts=4, top_k=2, intermediate_size=24)


def _model(**overrides: Any) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(DecoderConfig(**(SMALL | overrides))).eval()


def test_layout_default_is_attention_and_dense() -> None:
    c = DecoderConfig(**SMALL)
    assert c.layers is None and c.layer_specs == (LayerSpec(),) * 3 and c.moe_layers == []
    m = DecoderLM(c)
    assert all(isinstance(layer.feed_forward, GatedFeedForward) for layer in m.layers)


def test_mixed_layout_builds_each_layer_from_its_spec() -> None:
    layers = (LayerSpec(), LayerSpec(ffn="moe", moe=MOE), LayerSpec(ffn="none"))
    m = _model(layers=layers)
    assert isinstance(m.layers[0].feed_forward, GatedFeedForward)
    assert isinstance(m.layers[1].feed_forward, MoEBlock)
    assert m.layers[2].feed_forward is None and m.layers[2].ffn_norm is None
    assert m.config.moe_layers == [1]
    out = m(torch.randint(0, 64, (2, 5)), output_router_logits=True)
    assert out.logits.shape == (2, 5, 64)
    assert out.router_logits is not None and len(out.router_logits) == 1
    assert out.router_logits[0].shape == (10, 4)


def test_config_round_trips_through_a_dict_with_its_layout(tmp_path: Any) -> None:
    c = DecoderConfig.mixtral(moe=MOE, **SMALL)
    back = DecoderConfig.from_dict(c.to_dict())
    assert back == c and isinstance(back.layers, tuple)
    assert isinstance(back.layers[0].moe, MoEConfig)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(layers=(LayerSpec(),)), "layers has 1 entries, num_hidden_layers is 3"),
        (dict(layers=(LayerSpec(mixer="mamba9"),) * 3), "'mamba9' is not a registered mixer"),
        (
            dict(layers=(LayerSpec(ffn="moe", moe=MoEConfig(router="expert_choice")),) * 3),
            "expert-choice",
        ),
    ],
)
def test_layout_errors_name_the_problem(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DecoderConfig(**(SMALL | kwargs))


def test_layer_spec_and_moe_config_errors() -> None:
    with pytest.raises(ValueError, match="needs moe=MoEConfig"):
        LayerSpec(ffn="moe")
    with pytest.raises(ValueError, match="takes no moe"):
        LayerSpec(moe=MOE)
    with pytest.raises(ValueError, match="ffn must be one of"):
        LayerSpec(ffn="sparse")
    with pytest.raises(ValueError, match="top_k \\(3\\) must be <= num_experts \\(2\\)"):
        MoEConfig(num_experts=2, top_k=3)
    with pytest.raises(ValueError, match="router must be one of"):
        MoEConfig(router="hash")
    with pytest.raises(ValueError, match="shared_expert_gate needs a shared expert"):
        MoEConfig(shared_expert_gate=True)


def test_router_logits_and_aux_loss_with_padding() -> None:
    m = _model(layers=(LayerSpec(ffn="moe", moe=MOE),) * 3)
    ids = torch.randint(0, 64, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0
    out = m(ids, attention_mask=mask, output_router_logits=True)
    assert out.router_logits is not None and len(out.router_logits) == 3
    expect = load_balancing_loss(out.router_logits, 4, 2, mask)
    assert out.aux_loss is not None
    torch.testing.assert_close(out.aux_loss, expect)
    plain = m(ids, attention_mask=mask)
    assert plain.router_logits is None and plain.aux_loss is None


def test_cached_decoding_equals_the_full_forward_even_with_capacity_dispatch() -> None:
    # capacity dispatch applies in training; evaluation (and cached decoding) is dropless,
    # so a token's output never depends on its batch neighbours.
    moe = MoEConfig(
        num_experts=4,
        top_k=2,
        intermediate_size=24,
        dispatch="capacity",
        capacity_factor=0.5,
        shared_expert_intermediate_size=16,
        shared_expert_gate=True,
    )
    m = _model(layers=(LayerSpec(ffn="moe", moe=moe),) * 3)
    ids = torch.randint(1, 64, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, :2] = 0
    out = m.generate(ids, 6, attention_mask=mask)
    full_mask = torch.cat([mask, torch.ones(2, 6, dtype=torch.long)], 1)
    logits = m(out, attention_mask=full_mask).logits
    assert torch.equal(logits[:, 4:-1].argmax(-1), out[:, 5:])
    # the cached logits themselves equal the full forward
    cache = m.new_cache()
    step = m(out[:, :8], attention_mask=full_mask[:, :8], past_key_values=cache, use_cache=True)
    nxt = m(out[:, 8:9], attention_mask=full_mask[:, :9], past_key_values=step.past_key_values)
    torch.testing.assert_close(nxt.logits[:, 0], logits[:, 8], atol=1e-5, rtol=1e-5)


def test_training_capacity_dispatch_drops_and_reports() -> None:
    moe = MoEConfig(
        num_experts=4, top_k=2, intermediate_size=24, dispatch="capacity", capacity_factor=0.25
    )
    m = _model(layers=(LayerSpec(ffn="moe", moe=moe),) * 3).train()
    block = m.layers[0].feed_forward
    assert isinstance(block, MoEBlock)
    out = block(torch.randn(2, 16, 32))
    assert out.dropped is not None and 0.5 <= float(out.dropped) < 1.0
    block.eval()
    assert block(torch.randn(2, 16, 32)).dropped is None


class _ShiftMixer(nn.Module):
    """A stand-in non-attention mixer: mixes each token with its predecessor."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, h: Tensor, plan: Any, cache: Any = None) -> tuple[Tensor, None]:
        prev = torch.nn.functional.pad(h, (0, 0, 1, 0))[:, :-1]
        return self.proj(h + prev), None


def test_a_registered_mixer_is_built_without_a_decoder_branch() -> None:
    mixers.register_mixer(
        mixers.Mixer(name="shift", build=lambda config, parts: _ShiftMixer(config.hidden_size))
    )
    try:
        layers = (LayerSpec(mixer="shift", ffn="moe", moe=MOE), LayerSpec(), LayerSpec())
        m = _model(layers=layers)
        assert isinstance(m.layers[0].self_attention, _ShiftMixer)
        assert m(torch.randint(0, 64, (1, 4))).logits.shape == (1, 4, 64)
    finally:
        mixers._MIXERS.pop("shift")
    with pytest.raises(ValueError, match="unknown mixer 'shift'"):
        mixers.get_mixer("shift")


def test_router_loss_weights_both_losses() -> None:
    moe = MoEConfig(
        num_experts=4,
        top_k=2,
        intermediate_size=24,
        router_aux_loss_coef=0.01,
        router_z_loss_coef=0.001,
    )
    m = _model(layers=(LayerSpec(ffn="moe", moe=moe),) * 3)
    out = m(torch.randint(0, 64, (2, 5)), output_router_logits=True)
    assert out.router_logits is not None and out.aux_loss is not None
    expect = 0.01 * out.aux_loss + 0.001 * router_z_loss(out.router_logits)
    torch.testing.assert_close(m.router_loss(out.router_logits), expect)
    expect.backward()  # differentiable: reaches the router weights
    block = m.layers[0].feed_forward
    assert isinstance(block, MoEBlock) and block.router.weight.grad is not None
