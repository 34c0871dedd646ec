"""Bamba (a Mamba-2 hybrid: Mamba-2 layers + GQA attention with half-rotary RoPE) against
transformers' ``BambaForCausalLM`` on the same weights: logits, round trip, greedy
decoding, cached decoding, a saved folder. transformers runs its PyTorch fallback (SSD
in chunks) on CPU: an exact peer for values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import attnlab
from attnlab.cache.kv_cache import DynamicKVCache
from attnlab.cache.recurrent import Mamba2State
from attnlab.models.decoder import DecoderLM

transformers = pytest.importorskip("transformers")

TOL = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture(scope="module")
def hf_bamba() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.BambaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_indices=[1],
        mamba_n_heads=8,
        mamba_d_head=8,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=16,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )
    model = transformers.BambaForCausalLM(cfg).eval()
    with torch.no_grad():  # random init leaves norms at 1: perturb every weight
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def test_layout_and_parameters(hf_bamba: torch.nn.Module) -> None:
    ours = attnlab.from_hf(hf_bamba)
    assert isinstance(ours, DecoderLM)
    assert [s.mixer for s in ours.config.layer_specs] == ["mamba2", "attention", "mamba2"]
    assert ours.num_parameters() == sum(p.numel() for p in hf_bamba.parameters())
    kinds = [type(c) for c in ours.new_cache().layers]
    assert kinds == [Mamba2State, DynamicKVCache, Mamba2State]


def test_logits_match_transformers(hf_bamba: torch.nn.Module) -> None:
    ours = attnlab.from_hf(hf_bamba)
    ids = torch.randint(1, 97, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf_bamba(ids).logits, **TOL)


def test_to_hf_round_trip(hf_bamba: torch.nn.Module) -> None:
    ours = attnlab.from_hf(hf_bamba)
    back = attnlab.to_hf(ours)
    assert type(back).__name__ == "BambaForCausalLM"
    assert back.config.layers_block_type == hf_bamba.config.layers_block_type
    ids = torch.randint(1, 97, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf_bamba(ids).logits, **TOL)


def test_greedy_generation_and_cached_decoding(hf_bamba: torch.nn.Module) -> None:
    ours = attnlab.from_hf(hf_bamba)
    ids = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = hf_bamba.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        out = ours.generate(ids, max_new_tokens=32)
        assert torch.equal(out, theirs)
        full = ours(out).logits
        cache = ours.new_cache()
        steps = [ours(out[:, :7], past_key_values=cache).logits]
        steps += [ours(out[:, t : t + 1], past_key_values=cache).logits for t in range(7, 39)]
    torch.testing.assert_close(torch.cat(steps, 1), full, **TOL)


def test_a_saved_checkpoint_loads(hf_bamba: torch.nn.Module, tmp_path: Path) -> None:
    hf_bamba.save_pretrained(tmp_path)
    ours = attnlab.from_hf(str(tmp_path))
    ids = torch.randint(1, 97, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf_bamba(ids).logits, **TOL)
