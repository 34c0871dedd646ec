"""LFM2 (gated short convolutions + GQA attention with per-head QK-norm) against
transformers' ``Lfm2ForCausalLM`` on the same weights: logits, round trip, greedy
decoding, cached decoding, a saved folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import attnlab
from attnlab.cache.kv_cache import DynamicKVCache
from attnlab.cache.linear_state import ShortConvState
from attnlab.models.decoder import DecoderLM

transformers = pytest.importorskip("transformers")

TOL = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture(scope="module")
def hf_lfm2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.Lfm2Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=96,
        block_multiple_of=16,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
        conv_L_cache=3,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )
    model = transformers.Lfm2ForCausalLM(cfg).eval()
    with torch.no_grad():  # random init leaves norms at 1: perturb every weight
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def test_layout_and_parameters(hf_lfm2: torch.nn.Module) -> None:
    ours = attnlab.from_hf(hf_lfm2)
    assert isinstance(ours, DecoderLM)
    assert [s.mixer for s in ours.config.layer_specs] == [
        "short_conv",
        "attention",
        "short_conv",
        "attention",
    ]
    assert ours.num_parameters() == sum(p.numel() for p in hf_lfm2.parameters())
    cache = ours.new_cache()
    assert [type(c) for c in cache.layers] == [
        ShortConvState,
        DynamicKVCache,
        ShortConvState,
        DynamicKVCache,
    ]


def test_logits_match_transformers(hf_lfm2: torch.nn.Module) -> None:
    ours = attnlab.from_hf(hf_lfm2)
    ids = torch.randint(1, 97, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf_lfm2(ids).logits, **TOL)


def test_to_hf_round_trip(hf_lfm2: torch.nn.Module) -> None:
    ours = attnlab.from_hf(hf_lfm2)
    back = attnlab.to_hf(ours)
    assert type(back).__name__ == "Lfm2ForCausalLM"
    assert back.config.layer_types == hf_lfm2.config.layer_types
    ids = torch.randint(1, 97, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf_lfm2(ids).logits, **TOL)


def test_greedy_generation_and_cached_decoding(hf_lfm2: torch.nn.Module) -> None:
    ours = attnlab.from_hf(hf_lfm2)
    ids = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = hf_lfm2.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        out = ours.generate(ids, max_new_tokens=32)
        assert torch.equal(out, theirs)
        full = ours(out).logits
        cache = ours.new_cache()
        steps = [ours(out[:, :7], past_key_values=cache).logits]
        steps += [ours(out[:, t : t + 1], past_key_values=cache).logits for t in range(7, 39)]
    torch.testing.assert_close(torch.cat(steps, 1), full, **TOL)


def test_a_saved_checkpoint_loads(hf_lfm2: torch.nn.Module, tmp_path: Path) -> None:
    hf_lfm2.save_pretrained(tmp_path)
    ours = attnlab.from_hf(str(tmp_path))
    ids = torch.randint(1, 97, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf_lfm2(ids).logits, **TOL)


def test_to_hf_refuses_what_lfm2_cannot_hold(hf_lfm2: torch.nn.Module) -> None:
    from dataclasses import replace

    from attnlab.models.layout import LayerSpec

    ours = attnlab.from_hf(hf_lfm2)
    specs = list(ours.config.layer_specs)
    specs[0] = LayerSpec(mixer="gla")
    with pytest.raises(ValueError, match="short-convolution or attention"):
        attnlab.to_hf(DecoderLM(replace(ours.config, layers=tuple(specs))))
