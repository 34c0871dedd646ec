"""Jamba (hybrid attention + Mamba + MoE) against transformers on the same weights.

A tiny random ``JambaConfig`` with every kind of layer: Mamba + dense MLP, attention +
MoE, in the period/offset layout transformers derives from the config. transformers runs
its PyTorch fallbacks on CPU (a sequential scan): an exact peer for values.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import attnlab
from attnlab.models.decoder import DecoderLM

transformers = pytest.importorskip("transformers")

TOL = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture(scope="module")
def hf_jamba() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.JambaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        mamba_d_state=8,
        mamba_dt_rank=4,
        pad_token_id=0,
        eos_token_id=None,
    )
    model = transformers.JambaForCausalLM(cfg).eval()
    with torch.no_grad():  # random init leaves norms at 1 and some weights round: perturb
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def test_layout_follows_the_periods(hf_jamba: torch.nn.Module) -> None:
    ours = attnlab.from_hf(hf_jamba)
    assert isinstance(ours, DecoderLM)
    specs = ours.config.layer_specs
    assert [s.mixer for s in specs] == ["mamba", "attention", "mamba", "attention"]
    assert [s.ffn for s in specs] == ["dense", "moe", "dense", "moe"]
    assert ours.num_parameters() == sum(p.numel() for p in hf_jamba.parameters())


def test_logits_match_transformers(hf_jamba: torch.nn.Module) -> None:
    ours = attnlab.from_hf(hf_jamba)
    ids = torch.randint(1, 97, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, use_cache=False).logits, hf_jamba(ids).logits, **TOL)


def test_to_hf_round_trip(hf_jamba: torch.nn.Module) -> None:
    ours = attnlab.from_hf(hf_jamba)
    back = attnlab.to_hf(ours)
    assert type(back).__name__ == "JambaForCausalLM"
    assert back.config.layers_block_type == hf_jamba.config.layers_block_type
    assert back.config.layers_num_experts == hf_jamba.config.layers_num_experts
    ids = torch.randint(1, 97, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf_jamba(ids).logits, **TOL)


def test_to_hf_rejects_a_layout_without_a_period() -> None:
    ours = attnlab.from_hf(
        transformers.JambaForCausalLM(
            transformers.JambaConfig(
                vocab_size=31,
                hidden_size=16,
                intermediate_size=16,
                num_hidden_layers=4,
                num_attention_heads=2,
                num_key_value_heads=2,
                num_experts=1,
                attn_layer_period=2,
                attn_layer_offset=1,
                mamba_d_state=4,
            )
        )
    )
    specs = list(ours.config.layer_specs)  # mamba, attention, mamba, attention
    specs[0] = specs[1]  # attention, attention, mamba, attention: no period fits
    from dataclasses import replace

    bad = DecoderLM(replace(ours.config, layers=tuple(specs)))
    with pytest.raises(ValueError, match="no such period"):
        attnlab.to_hf(bad)


def test_greedy_generation_matches_transformers(hf_jamba: torch.nn.Module) -> None:
    ours = attnlab.from_hf(hf_jamba)
    ids = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = hf_jamba.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert torch.equal(ours.generate(ids, max_new_tokens=32), theirs)


def test_a_saved_checkpoint_loads(hf_jamba: torch.nn.Module, tmp_path: Path) -> None:
    hf_jamba.save_pretrained(tmp_path)  # experts saved one tensor each
    ours = attnlab.from_hf(str(tmp_path))
    ids = torch.randint(1, 97, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf_jamba(ids).logits, **TOL)
