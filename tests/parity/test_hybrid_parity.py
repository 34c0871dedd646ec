"""The hybrid decoders of the linear/recurrent family against transformers on the same
weights, one harness for all: Qwen3-Next (Gated DeltaNet + gated attention, MoE with a
gated shared expert), RecurrentGemma (Griffin: RG-LRU blocks + local MQA attention), LFM2
(gated short convolutions + GQA with per-head QK-norm) and Bamba (Mamba-2 + GQA with
half-rotary RoPE).

For each: the layout and parameter count, logits, the round trip through ``to_hf``,
greedy decoding (32 tokens), cached decoding equal to the forward, a saved folder, and
``to_hf`` refusing what the architecture cannot hold. transformers runs its PyTorch
paths on CPU: exact peers for values. (Jamba, with its period/offset layout and per-expert
checkpoints, has its own file.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

import attnlab
from attnlab.cache.kv_cache import DynamicKVCache, SlidingWindowKVCache
from attnlab.cache.linear_state import DeltaNetState, RGLRUState, ShortConvState
from attnlab.cache.recurrent import Mamba2State
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.layout import LayerSpec

transformers = pytest.importorskip("transformers")

TOL = {"atol": 1e-4, "rtol": 1e-4}
VOCAB = 97


@dataclass(frozen=True)
class Case:
    """One architecture: its tiny transformers config and what attnlab should make of it."""

    name: str
    config_class: str
    model_class: str
    config: dict[str, Any]
    mixers: list[str]
    caches: list[type]
    ffns: list[str] | None = None  # checked where the layout mixes feed-forward kinds
    logits_len: int = 21
    layout_attr: str = "layers_block_type"  # the transformers config field of the layout
    exact_round_trip: bool = False  # compare the state dicts exactly (else the logits)


CASES = [
    Case(
        name="qwen3_next",
        config_class="Qwen3NextConfig",
        model_class="Qwen3NextForCausalLM",
        config=dict(
            intermediate_size=48,
            num_hidden_layers=4,
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
            layer_types=["linear_attention", "full_attention"] * 2,
        ),
        mixers=["gated_delta_net", "gated_attention"] * 2,
        caches=[DeltaNetState, DynamicKVCache] * 2,
        ffns=["moe", "dense", "moe", "moe"],
        logits_len=70,  # more than a chunk
        layout_attr="layer_types",
        exact_round_trip=True,
    ),
    Case(
        name="recurrent_gemma",
        config_class="RecurrentGemmaConfig",
        model_class="RecurrentGemmaForCausalLM",
        config=dict(
            intermediate_size=96,
            num_hidden_layers=3,
            num_key_value_heads=1,
            lru_width=48,
            attention_window_size=16,
            conv1d_width=4,
            logits_soft_cap=30.0,
        ),
        mixers=["rglru", "rglru", "attention"],
        caches=[RGLRUState, RGLRUState, SlidingWindowKVCache],
        logits_len=29,  # more than the window
    ),
    Case(
        name="lfm2",
        config_class="Lfm2Config",
        model_class="Lfm2ForCausalLM",
        config=dict(
            intermediate_size=96,
            block_multiple_of=16,
            num_hidden_layers=4,
            num_key_value_heads=2,
            layer_types=["conv", "full_attention"] * 2,
            conv_L_cache=3,
        ),
        mixers=["short_conv", "attention"] * 2,
        caches=[ShortConvState, DynamicKVCache] * 2,
        layout_attr="layer_types",
    ),
    Case(
        name="bamba",
        config_class="BambaConfig",
        model_class="BambaForCausalLM",
        config=dict(
            intermediate_size=48,
            num_hidden_layers=3,
            num_key_value_heads=2,
            attn_layer_indices=[1],
            mamba_n_heads=8,
            mamba_d_head=8,
            mamba_n_groups=2,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=16,
        ),
        mixers=["mamba2", "attention", "mamba2"],
        caches=[Mamba2State, DynamicKVCache, Mamba2State],
        logits_len=37,  # more than two chunks
    ),
]
BY_NAME = {c.name: c for c in CASES}


@functools.cache
def _hf_model(name: str) -> torch.nn.Module:
    case = BY_NAME[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, case.config_class)(
        vocab_size=VOCAB,
        hidden_size=32,
        num_attention_heads=4,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
        **case.config,
    )
    model = getattr(transformers, case.model_class)(cfg).eval()
    with torch.no_grad():  # random init leaves norms at 0 or 1, biases at 0: perturb all
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.fixture(params=[c.name for c in CASES])
def case(request: pytest.FixtureRequest) -> tuple[Case, torch.nn.Module]:
    return BY_NAME[request.param], _hf_model(request.param)


def _ids(length: int, seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_layout_and_parameters(case: tuple[Case, torch.nn.Module]) -> None:
    spec, hf = case
    ours = attnlab.from_hf(hf)
    assert isinstance(ours, DecoderLM)
    assert [s.mixer for s in ours.config.layer_specs] == spec.mixers
    if spec.ffns is not None:
        assert [s.ffn for s in ours.config.layer_specs] == spec.ffns
    assert ours.num_parameters() == sum(p.numel() for p in hf.parameters())
    assert [type(c) for c in ours.new_cache().layers] == spec.caches


def test_logits_match_transformers(case: tuple[Case, torch.nn.Module]) -> None:
    spec, hf = case
    ours = attnlab.from_hf(hf)
    ids = _ids(spec.logits_len, seed=1, batch=2)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, **TOL)


def test_to_hf_round_trip(case: tuple[Case, torch.nn.Module]) -> None:
    spec, hf = case
    back = attnlab.to_hf(attnlab.from_hf(hf))
    assert type(back).__name__ == spec.model_class
    assert getattr(back.config, spec.layout_attr) == getattr(hf.config, spec.layout_attr)
    if spec.exact_round_trip:
        theirs = hf.state_dict()
        for key, t in back.state_dict().items():
            torch.testing.assert_close(t, theirs[key], rtol=0, atol=0)
    else:
        ids = _ids(9, seed=2)
        with torch.no_grad():
            torch.testing.assert_close(back(ids).logits, hf(ids).logits, **TOL)


def test_greedy_generation_and_cached_decoding(case: tuple[Case, torch.nn.Module]) -> None:
    _, hf = case
    ours = attnlab.from_hf(hf)
    ids = _ids(7, seed=3, batch=2)
    with torch.no_grad():
        theirs = hf.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        out = ours.generate(ids, max_new_tokens=32)
        assert torch.equal(out, theirs)
        full = ours(out).logits
        cache = ours.new_cache()
        steps = [ours(out[:, :7], past_key_values=cache).logits]
        steps += [ours(out[:, t : t + 1], past_key_values=cache).logits for t in range(7, 39)]
    torch.testing.assert_close(torch.cat(steps, 1), full, **TOL)


def test_a_saved_checkpoint_loads(case: tuple[Case, torch.nn.Module], tmp_path: Path) -> None:
    _, hf = case
    hf.save_pretrained(tmp_path)
    ours = attnlab.from_hf(str(tmp_path))
    ids = _ids(9, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, **TOL)


def _replace_first_layer(c: DecoderConfig) -> DecoderConfig:
    return replace(c, layers=(LayerSpec(mixer="gla"), *c.layer_specs[1:]))


REFUSALS: list[tuple[str, Callable[[DecoderConfig], DecoderConfig], str]] = [
    ("qwen3_next", _replace_first_layer, "Gated DeltaNet or gated-attention"),
    ("lfm2", _replace_first_layer, "short-convolution or attention"),
    ("bamba", _replace_first_layer, "Mamba-2 or attention layers"),
    ("recurrent_gemma", lambda c: replace(c, final_logit_softcapping=None), "Gemma's norms"),
]


@pytest.mark.parametrize(("name", "edit", "match"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_to_hf_refuses_what_the_architecture_cannot_hold(
    name: str, edit: Callable[[DecoderConfig], DecoderConfig], match: str
) -> None:
    ours = attnlab.from_hf(_hf_model(name))
    assert isinstance(ours, DecoderLM)
    with pytest.raises(ValueError, match=match):
        attnlab.to_hf(DecoderLM(edit(ours.config)))
