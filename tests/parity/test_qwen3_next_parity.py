"""Qwen3-Next (Gated DeltaNet + gated attention, MoE with a gated shared expert) against
transformers' ``Qwen3NextForCausalLM`` on the same weights: logits, round trip, greedy
decoding, cached decoding, a saved folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import attnlab
from attnlab.cache.kv_cache import DynamicKVCache
from attnlab.cache.linear_state import DeltaNetState
from attnlab.models.decoder import DecoderLM

transformers = pytest.importorskip("transformers")

TOL = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture(scope="module")
def hf_next() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.Qwen3NextConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        mlp_only_layers=[1],
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )
    model = transformers.Qwen3NextForCausalLM(cfg).eval()
    with torch.no_grad():  # random init leaves norms at 0 and gates uniform: perturb
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def test_layout_and_parameters(hf_next: torch.nn.Module) -> None:
    ours = attnlab.from_hf(hf_next)
    assert isinstance(ours, DecoderLM)
    specs = ours.config.layer_specs
    assert [s.mixer for s in specs] == ["gated_delta_net", "gated_attention"] * 2
    assert [s.ffn for s in specs] == ["moe", "dense", "moe", "moe"]
    assert ours.num_parameters() == sum(p.numel() for p in hf_next.parameters())
    kinds = [type(c) for c in ours.new_cache().layers]
    assert kinds == [DeltaNetState, DynamicKVCache] * 2


def test_logits_match_transformers(hf_next: torch.nn.Module) -> None:
    ours = attnlab.from_hf(hf_next)
    ids = torch.randint(1, 97, (2, 70), generator=torch.Generator().manual_seed(1))  # > a chunk
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf_next(ids).logits, **TOL)


def test_to_hf_round_trip(hf_next: torch.nn.Module) -> None:
    ours = attnlab.from_hf(hf_next)
    back = attnlab.to_hf(ours)
    assert type(back).__name__ == "Qwen3NextForCausalLM"
    assert back.config.layer_types == hf_next.config.layer_types
    theirs = hf_next.state_dict()
    for key, t in back.state_dict().items():
        torch.testing.assert_close(t, theirs[key], rtol=0, atol=0)


def test_greedy_generation_and_cached_decoding(hf_next: torch.nn.Module) -> None:
    ours = attnlab.from_hf(hf_next)
    ids = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = hf_next.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        out = ours.generate(ids, max_new_tokens=32)
        assert torch.equal(out, theirs)
        full = ours(out).logits
        cache = ours.new_cache()
        steps = [ours(out[:, :7], past_key_values=cache).logits]
        steps += [ours(out[:, t : t + 1], past_key_values=cache).logits for t in range(7, 39)]
    torch.testing.assert_close(torch.cat(steps, 1), full, **TOL)


def test_a_saved_checkpoint_loads(hf_next: torch.nn.Module, tmp_path: Path) -> None:
    hf_next.save_pretrained(tmp_path)
    ours = attnlab.from_hf(str(tmp_path))
    ids = torch.randint(1, 97, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf_next(ids).logits, **TOL)
