"""Decoder LMs: cached decoding equals recomputation, masks, positions, errors."""

from __future__ import annotations

import pytest
import torch

from attnlab.cache import DynamicKVCache, ModelCache, SlidingWindowKVCache
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig

TINY = dict(
    vocab_size=61,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=48,
    max_position_embeddings=64,
)

CONFIGS = {
    "gpt2": DecoderConfig.gpt2(**TINY),
    "llama_gqa": DecoderConfig.llama(**TINY, num_key_value_heads=2),
    "llama_mqa_interleaved": DecoderConfig.llama(
        **TINY, num_key_value_heads=1, rope_convention="interleaved"
    ),
    "llama_linear": DecoderConfig.llama(**TINY, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama_yarn": DecoderConfig.llama(
        **TINY, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    ),
    "llama_llama3": DecoderConfig.llama(
        **TINY,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    ),
    "mistral": DecoderConfig.mistral(**TINY, num_key_value_heads=2, sliding_window=5),
    "bloom": DecoderConfig.bloom(**(TINY | {"num_attention_heads": 6, "hidden_size": 48,
                                            "intermediate_size": 192})),
    "sinusoidal": DecoderConfig.llama(**TINY, position_embedding="sinusoidal"),
}  # fmt: skip


def make(name: str) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(CONFIGS[name]).eval()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 61, (3, 14), generator=g)
    mask = torch.ones(3, 14, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, :6] = 0
    return ids, mask


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("padded", [False, True])
def test_cached_decoding_equals_full_recomputation(name: str, padded: bool) -> None:
    model = make(name)
    ids, mask = batch()
    m = mask if padded else None
    with torch.no_grad():
        full = model(ids, attention_mask=m).logits  # [B, 14, V]
        cache = model.new_cache()
        # a prompt of 6, a chunk of 3, then one token at a time
        steps = [(0, 6), (6, 9)] + [(t, t + 1) for t in range(9, 14)]
        for a, b in steps:
            out = model(
                ids[:, a:b],
                attention_mask=m[:, :b] if m is not None else None,
                past_key_values=cache,
                use_cache=True,
            )
            got = out.logits
            want = full[:, a:b]
            if m is not None:
                keep = m[:, a:b].bool()
                got, want = got[keep], want[keep]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert cache.length == 14


@pytest.mark.parametrize("name", ["llama_gqa", "mistral", "bloom"])
def test_static_cache_equals_recomputation(name: str) -> None:
    model = make(name)
    ids, mask = batch()
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        cache = model.new_cache(kind="static", max_length=20)
        model(ids[:, :8], attention_mask=mask[:, :8], past_key_values=cache)
        for t in range(8, 14):
            got = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache)
            torch.testing.assert_close(got.logits[:, 0], full[:, t], atol=1e-5, rtol=1e-5)


def test_mistral_uses_a_rolling_cache_bounded_by_the_window() -> None:
    model = make("mistral")
    cache = model.new_cache()
    assert isinstance(cache.layers[0], SlidingWindowKVCache)
    ids, _ = batch()
    with torch.no_grad():
        model(ids[:, :10], past_key_values=cache)
        for t in range(10, 14):
            model(ids[:, t : t + 1], past_key_values=cache)
    layer = cache.layers[0]
    assert isinstance(layer, SlidingWindowKVCache)
    assert layer.k is not None and layer.k.shape[2] == 5


def test_sliding_window_changes_the_result_beyond_the_window() -> None:
    ids, _ = batch()
    a = make("mistral")
    b = DecoderLM(DecoderConfig.llama(**TINY, num_key_value_heads=2)).eval()
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        la, lb = a(ids).logits, b(ids).logits
    torch.testing.assert_close(la[:, :5], lb[:, :5])  # within the window: identical
    assert (la[:, 6:] - lb[:, 6:]).abs().max() > 1e-3


def test_left_padding_gives_the_unpadded_result() -> None:
    model = make("llama_gqa")
    ids, _ = batch()
    row = ids[:1, 4:]  # 10 tokens
    padded = torch.cat((torch.zeros(1, 4, dtype=torch.long), row), dim=1)
    mask = torch.cat((torch.zeros(1, 4), torch.ones(1, 10)), dim=1).long()
    with torch.no_grad():
        alone = model(row).logits
        pad = model(padded, attention_mask=mask).logits[:, 4:]
    torch.testing.assert_close(pad, alone, atol=1e-5, rtol=1e-5)


def test_attention_weights_and_hidden_states() -> None:
    model = make("bloom")
    ids, mask = batch()
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
    assert out.attentions is not None and len(out.attentions) == 2
    w = out.attentions[0]
    assert w.shape == (3, 6, 14, 14)
    assert bool((w.triu(1) == 0).all())  # causal
    assert bool((w[2, :, 6:, :6] == 0).all())  # padding never attended
    assert out.hidden_states is not None and len(out.hidden_states) == 3


def test_tied_embeddings_share_one_matrix() -> None:
    model = make("gpt2")
    assert model.lm_head is None and model.output_weight is model.embed_tokens.weight


def test_errors_name_the_values() -> None:
    model = make("gpt2")
    ids, mask = batch()
    with pytest.raises(ValueError, match="batch 3"):
        model(ids, attention_mask=mask[:2])
    with pytest.raises(ValueError, match="cached \\+ new"):
        model(ids, attention_mask=mask[:, :5])
    with pytest.raises(ValueError, match=r"\[0, 64\)"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="vocab_size=61"):
        model(torch.full((1, 3), 99))
    with pytest.raises(ValueError, match="unknown RoPE scaling type 'ntk-by-parts'"):
        DecoderConfig.llama(**TINY, rope_scaling={"rope_type": "ntk-by-parts", "factor": 2.0})
    with pytest.raises(ValueError, match="num_key_value_heads \\(3\\)"):
        DecoderConfig.llama(**TINY, num_key_value_heads=3)
    cache = ModelCache.build(2, lambda: DynamicKVCache())
    with torch.no_grad():
        model(ids, past_key_values=cache)
        with pytest.raises(ValueError, match="batch size 2"):
            model(ids[:2, :1], past_key_values=cache)


def test_dynamic_ntk_is_unscaled_within_max_positions() -> None:
    cfg = DecoderConfig.llama(**TINY, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    torch.manual_seed(0)
    dyn = DecoderLM(cfg).eval()
    plain = DecoderLM(DecoderConfig.llama(**TINY)).eval()
    plain.load_state_dict(dyn.state_dict())
    ids, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(dyn(ids).logits, plain(ids).logits)
        long_ids = torch.randint(0, 61, (1, 80))
        assert (dyn(long_ids).logits - plain(long_ids).logits).abs().max() > 1e-4
