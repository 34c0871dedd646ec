"""A hybrid decoder (Jamba-style): attention and Mamba layers, dense and MoE feed-forwards,
decoding with one cache object that mixes KV caches and recurrent states."""

from __future__ import annotations

import pytest
import torch

from attnlab.cache.base import KVCache, LayerCache
from attnlab.cache.kv_cache import DynamicKVCache
from attnlab.cache.recurrent import MambaState
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.layout import LayerSpec, MambaLayerConfig, MoEConfig

MAMBA = LayerSpec(mixer="mamba", mamba=MambaLayerConfig(state_size=4, inner_norms=True))
ATTN_MOE = LayerSpec(
    ffn="moe", moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=24, norm_topk_prob=False)
)


def _model(layers: tuple[LayerSpec, ...] = (MAMBA, ATTN_MOE, MAMBA)) -> DecoderLM:
    torch.manual_seed(0)
    config = DecoderConfig(
        vocab_size=53,
        hidden_size=16,
        num_hidden_layers=len(layers),
        num_attention_heads=2,
        intermediate_size=24,
        position_embedding="none",
        layers=layers,
    )
    return DecoderLM(config).eval()


def test_one_cache_mixes_kv_caches_and_states() -> None:
    model = _model()
    cache = model.new_cache()
    assert [type(c) for c in cache.layers] == [MambaState, DynamicKVCache, MambaState]
    assert all(isinstance(c, LayerCache) for c in cache.layers)
    ids = torch.randint(0, 53, (3, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids, past_key_values=cache)
    assert cache.length == 6
    kv = cache.layers[1]
    assert isinstance(kv, KVCache)
    states = cache.layers[0].nbytes() + cache.layers[2].nbytes()
    assert cache.nbytes() == kv.nbytes() + states
    # the states do not grow with the context; the KV cache does
    with torch.no_grad():
        model(ids[:, :1], past_key_values=cache)
    assert cache.layers[0].nbytes() + cache.layers[2].nbytes() == states
    assert cache.length == 7
    cache.select(torch.tensor([2, 0]))
    assert all(c.batch_size == 2 for c in cache.layers)  # type: ignore[attr-defined]
    cache.reset()
    assert cache.length == 0 and cache.nbytes() == 0


def test_cached_decoding_equals_the_forward_at_every_step() -> None:
    model = _model()
    ids = torch.randint(0, 53, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache()
        steps = [model(ids[:, :5], past_key_values=cache).logits]
        for t in range(5, 12):
            steps.append(model(ids[:, t : t + 1], past_key_values=cache).logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_generate_and_stream_agree() -> None:
    model = _model()
    ids = torch.randint(0, 53, (2, 4), generator=torch.Generator().manual_seed(3))
    out = model.generate(ids, max_new_tokens=6)
    streamed = torch.stack(list(model.stream(ids, max_new_tokens=6)), dim=1)  # [B] per step
    assert torch.equal(out[:, 4:], streamed)


def test_left_padding_equals_each_row_alone() -> None:
    model = _model()
    ids = torch.randint(1, 53, (2, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1] * 7])
    with torch.no_grad():
        padded = model(ids, attention_mask=mask).logits
        alone = model(ids[:1, 3:]).logits
    torch.testing.assert_close(padded[0, 3:], alone[0], atol=1e-5, rtol=1e-5)
    out = model.generate(ids, max_new_tokens=6, attention_mask=mask)
    assert torch.equal(out[0, 7:], model.generate(ids[:1, 3:], max_new_tokens=6)[0, 4:])


def test_bad_layouts_and_caches_are_rejected() -> None:
    with pytest.raises(ValueError, match="mixer='mamba'"):
        LayerSpec(mixer="attention", mamba=MambaLayerConfig())
    with pytest.raises(ValueError, match="state_size"):
        MambaLayerConfig(state_size=0)
    model = _model()
    cache = model.new_cache()
    cache.layers[0] = DynamicKVCache()  # a KV cache where a Mamba layer keeps its state
    with pytest.raises(TypeError, match="recurrent state"):
        model(torch.tensor([[1, 2]]), past_key_values=cache)


def test_the_cost_model_refuses_a_hybrid_rather_than_miscount_it() -> None:
    from attnlab.analysis.cost import estimate

    with pytest.raises(ValueError, match="hybrid"):
        estimate(_model().config, seq_len=64)
