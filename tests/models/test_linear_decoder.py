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
    with torch.no_grad():  # RWKV-7's value gate starts with a zero down projection (its
        for n, p in model.named_parameters():  # up projection's first gradient is 0)
            if n.endswith("v_lora.0.weight"):
                p.normal_(0, 0.1)
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


def _rwkv7(role: str, seed: int = 0) -> torch.nn.Module:
    from attnlab.modules.rwkv7 import RWKV7TimeMix

    torch.manual_seed(seed)
    return RWKV7TimeMix(hidden_size=16, num_heads=2, chunk_size=4, value_residual=role)


def test_rwkv7_value_residual_is_the_papers_lerp() -> None:
    """RWKV-7's value residual, v = v + (v_first - v) sigmoid(v_lora(x_v)), checked on the
    layer's linearity in its values: with a constant gate s (zero down projection, bias b)
    and v_first = W2 x_v, the mixing layer equals a plain layer whose value projection is
    (1 - s) W + s W2 (and W2 itself as s -> 1, W as s -> 0)."""
    mix = _rwkv7("mix").double()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    shifted = torch.cat((torch.zeros_like(x[:, :1]), x[:, :-1]), dim=1)
    xv = x + (shifted - x) * mix.x_v
    w2 = torch.randn(16, 16, dtype=torch.float64) * 0.3
    v_first = xv @ w2.T
    for bias in (-40.0, 0.3, 40.0):
        with torch.no_grad():
            mix.v_lora[-1].bias.fill_(bias)
        s = torch.sigmoid(torch.tensor(bias, dtype=torch.float64))
        plain = _rwkv7("none").double()
        plain.load_state_dict({k: v for k, v in mix.state_dict().items() if "v_lora" not in k})
        with torch.no_grad():
            plain.v_proj.weight.copy_((1 - s) * mix.v_proj.weight + s * w2)
        torch.testing.assert_close(mix(x, v_first=v_first), plain(x), atol=1e-10, rtol=1e-10)


def test_rwkv7_layers_hand_the_first_layers_values_on() -> None:
    """In a decoder, the first RWKV-7 layer (after an attention layer here) hands its values
    to the later ones: the decoder equals its layers run by hand with v_first passed."""
    model = _model("rwkv7", hybrid=False)
    config = DecoderConfig(
        vocab_size=53,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=24,
        layers=(LayerSpec(), *model.config.layer_specs),
    )
    model = DecoderLM(config).eval()
    roles = [getattr(layer.self_attention, "mixer", None) for layer in model.layers]
    assert [getattr(r, "value_residual", None) for r in roles] == [None, "first", "mix"]
    ids = torch.randint(0, 53, (2, 7), generator=torch.Generator().manual_seed(1))
    captured: dict[str, torch.Tensor] = {}
    first, later = roles[1], roles[2]
    assert first is not None and later is not None
    hook = first.v_proj.register_forward_hook(lambda m, i, o: captured.setdefault("v", o))
    seen: list[torch.Tensor] = []
    original = later.forward
    later.forward = lambda x, **kw: (seen.append(kw["v_first"]), original(x, **kw))[1]
    model(ids)
    hook.remove()
    assert len(seen) == 1 and torch.equal(seen[0], captured["v"])
    off = LinearLayerConfig(num_heads=2, chunk_size=4, value_residual=False)
    plain = DecoderLM(
        DecoderConfig(
            vocab_size=53,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=24,
            layers=(LayerSpec(mixer="rwkv7", linear=off),) * 2,
        )
    )
    assert [layer.self_attention.mixer.value_residual for layer in plain.layers] == ["none"] * 2


def test_rwkv7_value_residual_refuses_a_missing_or_stray_v_first() -> None:
    x = torch.randn(1, 5, 16)
    with pytest.raises(ValueError, match="v_first"):
        _rwkv7("mix")(x)
    with pytest.raises(ValueError, match="v_first"):
        _rwkv7("mix")(x, v_first=torch.zeros(1, 4, 16))
    with pytest.raises(ValueError, match="value_residual"):
        _rwkv7("none")(x, v_first=torch.zeros(1, 5, 16))
    with pytest.raises(ValueError, match="value_residual"):
        _rwkv7("sometimes")
