"""RetNet as a preset of the one decoder shell: a DecoderLM of ``retention`` layers with
RetNetLM's weights computes RetNetLM's logits (padded batches and cached decoding
included) and generates its tokens; the retention mixer mixes with attention in one
layout, and its cached decoding equals its forward."""

from __future__ import annotations

import pytest
import torch

from attnlab.cache.kv_cache import DynamicKVCache
from attnlab.cache.recurrent import RetentionState
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.layout import LayerSpec
from attnlab.models.linear_layout import LinearLayerConfig
from attnlab.models.recurrent import RetNetLM
from attnlab.models.recurrent_config import RetNetConfig
from attnlab.models.recurrent_presets import retnet_as_decoder, retnet_decoder_config

V = 61
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _retnet(**kw: object) -> RetNetLM:
    torch.manual_seed(0)
    cfg = RetNetConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=2, num_heads=2, chunk_size=4, **kw
    )
    model = RetNetLM(cfg).eval()
    with torch.no_grad():  # norms start at 1: perturb every weight
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize(
    "kw",
    [{}, {"hidden_act": "swish", "scale_embedding": True, "tie_word_embeddings": True}],
    ids=["gelu", "swish-scaled-tied"],
)
def test_the_preset_computes_retnets_logits(kw: dict[str, object]) -> None:
    ours = _retnet(**kw)
    preset = retnet_as_decoder(ours)
    assert preset.num_parameters() == ours.num_parameters()
    assert [type(c) for c in preset.new_cache().layers] == [RetentionState] * 2
    ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        torch.testing.assert_close(preset(ids).logits, ours(ids).logits, **TOL)
        torch.testing.assert_close(
            preset(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits, **TOL
        )
        cache = preset.new_cache()
        steps = [preset(ids[:, :5], past_key_values=cache).logits]
        steps += [preset(ids[:, t : t + 1], past_key_values=cache).logits for t in range(5, 11)]
    torch.testing.assert_close(torch.cat(steps, 1), ours(ids).logits, **TOL)


def test_the_preset_generates_retnets_tokens() -> None:
    ours = _retnet()
    preset = retnet_as_decoder(ours)
    ids = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(2))
    assert torch.equal(preset.generate(ids, max_new_tokens=16), ours.generate(ids, 16))


def test_retention_mixes_with_attention() -> None:
    torch.manual_seed(0)
    retention = LayerSpec(mixer="retention", linear=LinearLayerConfig(num_heads=2, chunk_size=4))
    cfg = DecoderConfig(
        vocab_size=V,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=24,
        layers=(retention, LayerSpec(), retention),
    )
    model = DecoderLM(cfg).eval()
    assert [type(c) for c in model.new_cache().layers] == [
        RetentionState,
        DynamicKVCache,
        RetentionState,
    ]
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache()
        steps = [model(ids[:, :4], past_key_values=cache).logits]
        steps += [model(ids[:, t : t + 1], past_key_values=cache).logits for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), full, **TOL)


def test_bad_inputs_are_named() -> None:
    with pytest.raises(TypeError, match="RetNetConfig"):
        retnet_decoder_config(DecoderConfig(vocab_size=V))  # type: ignore[arg-type]
    small = DecoderConfig(
        vocab_size=V,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
    )
    with pytest.raises(TypeError, match="RetNetLM"):
        retnet_as_decoder(DecoderLM(small))  # type: ignore[arg-type]
