"""The context experiment's measurement: the swapped RoPE scalings against transformers'
formulas with SmolLM2's parameters, identities with a known answer on a tiny model, and the
pipeline on SmolLM2 (the session's one copy)."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from attnlab.experiments import _real, run_experiment
from attnlab.experiments.context import (
    chunked_nll,
    dynamic_nll,
    gapped_nll,
    scaling_for,
    swapped_rope,
)
from attnlab.models import DecoderConfig, DecoderLM

TRAINED = 8192  # SmolLM2's context
THETA = 100000.0  # SmolLM2's rope_theta

TINY: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,  # head dim 64, as SmolLM2's
    num_key_value_heads=1,
    intermediate_size=64,
    max_position_embeddings=TRAINED,
    rope_theta=THETA,
    tie_word_embeddings=True,
)


def _tiny(seed: int) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(DecoderConfig.llama(**TINY)).eval()


@pytest.mark.parametrize("variant", ["linear", "dynamic", "yarn"])
def test_swapped_rope_matches_transformers_rope_init_with_smollm2_parameters(
    variant: str,
) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    length = 2 * TRAINED  # the full run's last position + 1
    params = scaling_for(variant, factor=2.0, trained=TRAINED)
    assert params is not None
    # transformers' YaRN takes its factor from max_position_embeddings / original
    max_pos = length if variant == "yarn" else TRAINED
    cfg = LlamaConfig(
        hidden_size=576,
        num_attention_heads=9,
        max_position_embeddings=max_pos,
        rope_parameters={**params, "rope_theta": THETA},
    )
    ref_freq, ref_factor = ROPE_INIT_FUNCTIONS[variant](cfg, "cpu", seq_len=length)
    model = _tiny(0)
    with swapped_rope(model, params, trained=TRAINED):
        rotary = model.layers[0].self_attention.rotary
        # the angle at position 1 is the frequency; the last position sets dynamic's length
        cos, sin = rotary.angles(torch.tensor([1, length - 1]))
    freq = torch.atan2(sin[0, 0], cos[0, 0])  # [32], all below pi
    torch.testing.assert_close(freq, ref_freq.float(), rtol=1e-5, atol=0)
    scale = torch.sqrt(cos[0, 0] ** 2 + sin[0, 0] ** 2)
    torch.testing.assert_close(scale, torch.full_like(scale, ref_factor), rtol=1e-6, atol=0)
    if variant == "yarn":
        assert ref_factor == pytest.approx(0.1 * math.log(2.0) + 1)


def test_linear_interpolation_at_doubled_positions_equals_the_trained_rope() -> None:
    # Chen et al.: position interpolation reads position 2p as the trained RoPE reads p
    model = _tiny(1)
    ids = torch.randint(0, 64, (1, 40))
    p = torch.arange(40)[None]
    with torch.no_grad():
        want = model(ids, position_ids=p).logits
        with swapped_rope(
            model, scaling_for("linear", factor=2.0, trained=TRAINED), trained=TRAINED
        ):
            got = model(ids, position_ids=2 * p).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_swapped_rope_restores_the_trained_rope_and_refuses_a_model_without_one() -> None:
    model = _tiny(2)
    before = [layer.self_attention.rotary for layer in model.layers]
    with swapped_rope(model, scaling_for("yarn", factor=2.0, trained=TRAINED), trained=TRAINED):
        assert model.layers[1].self_attention.rotary.rope_type == "yarn"
    assert [layer.self_attention.rotary for layer in model.layers] == before
    nope = DecoderLM(DecoderConfig.llama(**(TINY | {"position_embedding": "none"})))
    with pytest.raises(ValueError, match="RoPE"), swapped_rope(nope, None, trained=TRAINED):
        pass
    with pytest.raises(ValueError, match="'ntk'"):
        scaling_for("ntk", factor=2.0, trained=TRAINED)


def test_chunked_scoring_equals_one_forward_for_a_static_scaling() -> None:
    model = _tiny(3)
    ids = torch.randint(0, 64, (1, 50))
    with swapped_rope(model, scaling_for("yarn", factor=4.0, trained=16), trained=16):
        with torch.no_grad():
            full = _real.next_token_nll(model(ids).logits[:, :-1], ids[:, 1:])[0]
        got = chunked_nll(model, ids, chunk=7)
    torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)


def test_dynamic_ntk_equals_the_trained_rope_within_the_trained_length() -> None:
    model = _tiny(4)
    ids = torch.randint(0, 64, (1, 48))
    plain = chunked_nll(model, ids, chunk=16)
    with swapped_rope(model, scaling_for("dynamic", factor=2.0, trained=48), trained=48):
        same = chunked_nll(model, ids, chunk=16)
    with swapped_rope(model, scaling_for("dynamic", factor=2.0, trained=32), trained=32):
        past = chunked_nll(model, ids, chunk=16)
    torch.testing.assert_close(same, plain, atol=0, rtol=0)
    torch.testing.assert_close(past[:31], plain[:31], atol=0, rtol=0)  # chunks ending <= 32
    assert not torch.equal(past[32:], plain[32:])


@pytest.mark.parametrize("length", [TRAINED, TRAINED + 1, 10240, 2 * TRAINED - 1])
def test_dynamic_ntk_fixed_at_a_length_matches_transformers_at_that_length(length: int) -> None:
    # the full run's spans end at 10240, 12288, 14336 and 16383
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = scaling_for("dynamic", factor=2.0, trained=TRAINED)
    cfg = LlamaConfig(
        hidden_size=576,
        num_attention_heads=9,
        max_position_embeddings=TRAINED,
        rope_parameters={**params, "rope_theta": THETA},
    )
    ref_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, "cpu", seq_len=length)
    model = _tiny(5)
    with swapped_rope(model, params, trained=TRAINED, length=length):
        cos, sin = model.layers[1].self_attention.rotary.angles(torch.tensor([1, 5]))
    torch.testing.assert_close(
        torch.atan2(sin[0, 0], cos[0, 0]), ref_freq.float(), rtol=1e-5, atol=0
    )
    with (
        pytest.raises(ValueError, match="dynamic"),
        swapped_rope(
            model, scaling_for("yarn", factor=2.0, trained=TRAINED), trained=TRAINED, length=length
        ),
    ):
        pass


def test_dynamic_nll_equals_transformers_dynamic_rotary_one_forward_per_span() -> None:
    """Each span's tokens equal transformers' Llama with dynamic NTK run once over the
    prefix up to the span's end (no cache: every key rotated with that length's base)."""
    import transformers

    import attnlab

    trained, span, t = 16, 8, 41
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=trained,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        tie_word_embeddings=False,
    )
    torch.manual_seed(6)
    pristine = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharp attention, so that a key rotated with another base shows
        for layer in pristine.model.layers:
            layer.self_attn.q_proj.weight.mul_(10)
            layer.self_attn.k_proj.weight.mul_(10)
    model = attnlab.from_hf(copy.deepcopy(pristine)).eval()
    ids = torch.randint(0, 64, (1, t))
    with swapped_rope(model, None, trained=trained):
        plain = chunked_nll(model, ids, chunk=5)
    got = dynamic_nll(model, ids, plain, factor=2.0, trained=trained, chunk=3, span=span)
    ends = [trained, *range(trained + span, t - 1, span), t - 1]  # 16, 24, 32, 40
    for a, b in zip([0, *ends[:-1]], ends, strict=True):
        hf = copy.deepcopy(pristine)  # its dynamic rotary keeps state between calls
        with torch.no_grad():
            logits = hf(ids[:, :b], use_cache=False).logits
        want = _real.next_token_nll(logits[:, a:b], ids[:, a + 1 : b + 1])[0]
        torch.testing.assert_close(got[a:b], want, atol=1e-5, rtol=1e-5)
    # one cache through the text, the base changing chunk by chunk, is not the same
    with swapped_rope(model, scaling_for("dynamic", factor=2.0, trained=trained), trained=16):
        cached = chunked_nll(model, ids, chunk=8)
    assert (cached[trained + span :] - got[trained + span :]).abs().max() > 1e-2


def test_gapped_scoring_without_a_gap_is_the_contiguous_text() -> None:
    model = _tiny(7)
    ids = torch.randint(0, 64, (1, 40))
    full = chunked_nll(model, ids, chunk=9)
    with torch.no_grad():
        got = gapped_nll(model, ids, at=20)
        far = gapped_nll(model, ids, at=200)
    torch.testing.assert_close(got, full[20:], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(far, got, atol=1e-3)  # the gap is seen
    with pytest.raises(ValueError, match="segment length 20"):
        gapped_nll(model, ids, at=19)
    with pytest.raises(ValueError, match="even length"):
        gapped_nll(model, ids[:, :39], at=30)


@pytest.fixture
def real_model(smollm2: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    monkeypatch.setattr(_real, "load_smollm2", lambda: smollm2)
    return smollm2


def test_context_pipeline_on_smollm2(real_model: torch.nn.Module, tmp_path: Path) -> None:
    result = run_experiment("context", smoke=True, out=tmp_path, progress=False)
    assert [r["rope"] for r in result.rows] == ["none", "linear", "dynamic", "yarn"]
    assert all(r["ppl_past"] > 1 for r in result.rows)
    # within the pretend trained length dynamic NTK is the trained RoPE
    assert result.rows[2]["ppl_before"] == pytest.approx(result.rows[0]["ppl_before"])
    assert (tmp_path / "plot.png").is_file()
    # the real model is left with its own RoPE
    assert real_model.layers[0].self_attention.rotary.rope_type == "default"


def test_context_quick_pipeline_on_smollm2(real_model: torch.nn.Module, tmp_path: Path) -> None:
    result = run_experiment("context", smoke=True, quick=True, out=tmp_path, progress=False)
    rows = {r["rope"]: r for r in result.rows}
    assert result.settings["mode"] == "gapped"
    # placed inside the pretend trained length, dynamic NTK is the trained RoPE
    assert rows["dynamic"]["ppl_before"] == rows["none"]["ppl_before"]
    assert all(r["ppl_past"] > 1 for r in result.rows)
    assert "16 tokens at positions 112-127 after 16 at 0-15" in result.verdict
    assert (tmp_path / "plot.png").is_file()
