"""The linear-attention and gated-recurrence mixers in decoder layouts, pure and hybrid:
one cache of KV caches and fixed-size states, cached decoding equal to the forward, left
padding equal to each row alone, training gradients, and clear errors."""

from __future__ import annotations

import pytest
import torch

from attnlab.cache.base import LayerCache
from attnlab.cache.kv_cache import DynamicKVCache
from attnlab.cache.linear_state import (
    DeltaNetState,
    GLAState,
    RGLRUState,
    RWKV7State,
    ShortConvState,
)
from attnlab.cache.recurrent import Mamba2State
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.layout import LayerSpec
from attnlab.models.linear_layout import LinearLayerConfig

STATES = {
    "delta_net": DeltaNetState,
    "gated_delta_net": DeltaNetState,
    "gla": GLAState,
    "rglru": RGLRUState,
    "short_conv": ShortConvState,
    "rwkv7": RWKV7State,
    "mamba2": Mamba2State,
}


def _model(mixer: str, hybrid: bool) -> DecoderLM:
    torch.manual_seed(0)
    lin = LinearLayerConfig(
        num_heads=None if mixer == "mamba2" else 2,
        num_value_heads=4 if "delta" in mixer else None,
        conv_kernel=3 if mixer == "short_conv" else 4,
        head_dim=8 if mixer == "mamba2" else None,
        state_size=4,
        chunk_size=4,
    )
    spec = LayerSpec(mixer=mixer, linear=lin)
    layers = (spec, LayerSpec(), spec) if hybrid else (spec, spec)
    config = DecoderConfig(
        vocab_size=53,
        hidden_size=16,
        num_hidden_layers=len(layers),
        num_attention_heads=2,
        intermediate_size=24,
        layers=layers,
    )
    return DecoderLM(config).eval()


@pytest.mark.parametrize("mixer", sorted(STATES))
def test_cached_decoding_equals_the_forward(mixer: str) -> None:
    model = _model(mixer, hybrid=True)
    ids = torch.randint(0, 53, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache()
        assert [type(c) for c in cache.layers] == [STATES[mixer], DynamicKVCache, STATES[mixer]]
        steps = [model(ids[:, :5], past_key_values=cache).logits]
        state_bytes = cache.layers[0].nbytes()
        for t in range(5, 11):
            steps.append(model(ids[:, t : t + 1], past_key_values=cache).logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    assert cache.layers[0].nbytes() == state_bytes > 0  # constant in the context
    assert all(isinstance(c, LayerCache) for c in cache.layers) and cache.length == 11
    cache.select(torch.tensor([1]))
    assert cache.layers[0].batch_size == 1  # type: ignore[attr-defined]
    cache.reset()
    assert cache.nbytes() == 0


@pytest.mark.parametrize("mixer", sorted(STATES))
def test_left_padding_equals_each_row_alone(mixer: str) -> None:
    model = _model(mixer, hybrid=False)
    ids = torch.randint(0, 53, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0
    with torch.no_grad():
        padded = model(ids, attention_mask=mask).logits
        alone = model(ids[:1, 3:]).logits
        greedy = model.generate(ids, attention_mask=mask, max_new_tokens=4)
        greedy_alone = model.generate(ids[:1, 3:], max_new_tokens=4)
    torch.testing.assert_close(padded[0, 3:], alone[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(greedy[0, 9:], greedy_alone[0, 6:])


@pytest.mark.parametrize("mixer", sorted(STATES))
def test_training_reaches_every_parameter(mixer: str) -> None:
    model = _model(mixer, hybrid=True).train()
    ids = torch.randint(0, 53, (2, 10), generator=torch.Generator().manual_seed(3))
    model(ids, labels=ids).loss.backward()
    unused = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert not unused


def test_layer_spec_checks_its_linear_settings() -> None:
    with pytest.raises(ValueError, match="configures a mixer"):
        LayerSpec(mixer="attention", linear=LinearLayerConfig())
    with pytest.raises(TypeError, match="LinearLayerConfig"):
        LayerSpec(mixer="gla", linear=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_size"):
        LinearLayerConfig(chunk_size=0)
    assert LayerSpec(mixer="gla", linear={"num_heads": 2}).linear == LinearLayerConfig(num_heads=2)


def test_a_kv_cache_in_a_state_layer_is_refused() -> None:
    model = _model("gla", hybrid=False)
    from attnlab.cache.kv_cache import ModelCache

    bad = ModelCache(layers=[DynamicKVCache(), DynamicKVCache()])
    with pytest.raises(TypeError, match="recurrent state"):
        model(torch.zeros(1, 3, dtype=torch.long), past_key_values=bad)
