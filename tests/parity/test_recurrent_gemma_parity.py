"""RecurrentGemma (Griffin: RG-LRU recurrent blocks + local MQA attention) against
transformers' ``RecurrentGemmaForCausalLM`` on the same weights: logits, round trip,
greedy decoding, cached decoding, a saved folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import attnlab
from attnlab.cache.kv_cache import SlidingWindowKVCache
from attnlab.cache.linear_state import RGLRUState
from attnlab.models.decoder import DecoderLM

transformers = pytest.importorskip("transformers")

TOL = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture(scope="module")
def hf_griffin() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.RecurrentGemmaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        lru_width=48,
        attention_window_size=16,
        conv1d_width=4,
        logits_soft_cap=30.0,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )
    model = transformers.RecurrentGemmaForCausalLM(cfg).eval()
    with torch.no_grad():  # random init leaves norms at 0 and biases at 0: perturb
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def test_layout_and_parameters(hf_griffin: torch.nn.Module) -> None:
    ours = attnlab.from_hf(hf_griffin)
    assert isinstance(ours, DecoderLM)
    assert [s.mixer for s in ours.config.layer_specs] == ["rglru", "rglru", "attention"]
    assert ours.num_parameters() == sum(p.numel() for p in hf_griffin.parameters())
    kinds = [type(c) for c in ours.new_cache().layers]
    assert kinds == [RGLRUState, RGLRUState, SlidingWindowKVCache]


def test_logits_match_transformers(hf_griffin: torch.nn.Module) -> None:
    ours = attnlab.from_hf(hf_griffin)
    ids = torch.randint(1, 97, (2, 29), generator=torch.Generator().manual_seed(1))  # > window
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf_griffin(ids).logits, **TOL)


def test_to_hf_round_trip(hf_griffin: torch.nn.Module) -> None:
    ours = attnlab.from_hf(hf_griffin)
    back = attnlab.to_hf(ours)
    assert type(back).__name__ == "RecurrentGemmaForCausalLM"
    assert back.config.layers_block_type == hf_griffin.config.layers_block_type
    ids = torch.randint(1, 97, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf_griffin(ids).logits, **TOL)


def test_greedy_generation_and_cached_decoding(hf_griffin: torch.nn.Module) -> None:
    ours = attnlab.from_hf(hf_griffin)
    ids = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = hf_griffin.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        out = ours.generate(ids, max_new_tokens=32)
        assert torch.equal(out, theirs)
        full = ours(out).logits
        cache = ours.new_cache()
        steps = [ours(out[:, :7], past_key_values=cache).logits]
        steps += [ours(out[:, t : t + 1], past_key_values=cache).logits for t in range(7, 39)]
    torch.testing.assert_close(torch.cat(steps, 1), full, **TOL)


def test_a_saved_checkpoint_loads(hf_griffin: torch.nn.Module, tmp_path: Path) -> None:
    hf_griffin.save_pretrained(tmp_path)
    ours = attnlab.from_hf(str(tmp_path))
    ids = torch.randint(1, 97, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf_griffin(ids).logits, **TOL)


def test_to_hf_refuses_what_recurrent_gemma_cannot_hold(hf_griffin: torch.nn.Module) -> None:
    from dataclasses import replace

    ours = attnlab.from_hf(hf_griffin)
    with pytest.raises(ValueError, match="Gemma's norms"):
        attnlab.to_hf(DecoderLM(replace(ours.config, final_logit_softcapping=None)))
