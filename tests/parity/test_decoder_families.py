"""Qwen2, Qwen3, Qwen3-MoE, Gemma 2, Gemma 3 (text), Phi-3, SmolLM3 against transformers 5.

One harness for every decoder: tiny random float32 configs, weights drawn wide enough
that the comparisons mean something, transformers' eager attention as the reference.

* logits of a left-padded batch within 1e-4 (transformers gets the positions);
* ``to_hf`` and a saved folder round trip within 1e-5;
* greedy generation identical for 32 tokens;
* cached decoding equal to the uncached forward at every step;
* the gradient of the language-model loss within 1e-4 for every weight;
* bfloat16 logits within transformers' own bfloat16 error of the float32 logits (the
  mean absolute error, at most twice transformers').
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import attnlab
from attnlab.backend_traits import TRAITS
from attnlab.interop.hf import _converter
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.layout import MoEConfig

tf = pytest.importorskip("transformers")

VOCAB = 80
BASE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    attn_implementation="eager",
)
WINDOWED = dict(use_sliding_window=True, sliding_window=5, layer_types=None, max_window_layers=1)


def _qwen3_moe() -> Any:
    cfg = tf.Qwen3MoeConfig(
        **BASE,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    )
    return tf.Qwen3MoeForCausalLM(cfg)


GEMMA: dict[str, Any] = dict(BASE, head_dim=8, query_pre_attn_scalar=10, sliding_window=5)


def _gemma2() -> Any:
    cfg = tf.Gemma2Config(**GEMMA, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    return tf.Gemma2ForCausalLM(cfg)


def _gemma3() -> Any:
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    }
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    cfg = tf.Gemma3TextConfig(**GEMMA, layer_types=types, rope_parameters=rope)
    return tf.Gemma3ForCausalLM(cfg)


def _phi3() -> Any:
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
        "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0],
        "partial_rotary_factor": 0.75,
    }
    cfg = tf.Phi3Config(
        **(BASE | {"hidden_size": 64, "max_position_embeddings": 32}),
        original_max_position_embeddings=12,  # the 14-token batch runs the long factors
        rope_parameters=rope,
        sliding_window=9,
    )
    return tf.Phi3ForCausalLM(cfg)


def _smollm3() -> Any:
    cfg = tf.SmolLM3Config(**(BASE | {"num_hidden_layers": 4}), no_rope_layer_interval=2)
    return tf.SmolLM3ForCausalLM(cfg)


CASES: dict[str, Callable[[], Any]] = {
    "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**BASE, **WINDOWED)),
    "qwen2_tied": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**BASE, tie_word_embeddings=True)),
    "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**BASE, head_dim=16, **WINDOWED)),
    "qwen3_moe": _qwen3_moe,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "smollm3": _smollm3,
}


def _hf(name: str) -> Any:
    torch.manual_seed(0)
    model = CASES[name]().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(torch.empty_like(p).uniform_(-0.2, 0.2))
            elif pname.endswith("mlp.gate.weight"):
                p.normal_(0, 1.0)  # decisive routing: no near-ties between experts
            else:
                p.normal_(0, 0.12)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _batch(length: int = 14) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (3, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :7] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    return ids.masked_fill(mask == 0, 0), mask, pos


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest) -> tuple[str, Any, DecoderLM]:
    hf = _hf(request.param)
    ours = attnlab.from_hf(hf)
    assert isinstance(ours, DecoderLM)
    return request.param, hf, ours


def test_logits_match_with_left_padding(pair: tuple[str, Any, DecoderLM]) -> None:
    _, hf, ours = pair
    ids, mask, pos = _batch()
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, position_ids=pos).logits
        got = ours(ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], ref[keep], atol=1e-4, rtol=0)
    assert ref.abs().max() > 1.0  # a meaningful comparison


def test_round_trip_to_hf_and_through_a_folder(
    pair: tuple[str, Any, DecoderLM], tmp_path: Path
) -> None:
    _, hf, ours = pair
    back = attnlab.to_hf(ours)
    assert type(back) is type(hf)
    ids, _, _ = _batch()
    with torch.no_grad():
        ref = hf(ids).logits
        torch.testing.assert_close(back(ids).logits, ref, atol=1e-5, rtol=0)
    hf.save_pretrained(tmp_path)
    loaded = attnlab.from_hf(tmp_path)
    assert loaded.config == ours.config
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, ref, atol=1e-5, rtol=0)


def test_greedy_generation_matches(pair: tuple[str, Any, DecoderLM]) -> None:
    _, hf, ours = pair
    ids, mask, _ = _batch(8)
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
    got = ours.generate(ids, 32, attention_mask=mask)
    assert torch.equal(got, ref)


def test_cached_decoding_equals_the_uncached_forward(pair: tuple[str, Any, DecoderLM]) -> None:
    _, _, ours = pair
    ids, mask, _ = _batch(12)
    with torch.no_grad():
        full = ours(ids, attention_mask=mask).logits
        out = ours(ids[:, :4], attention_mask=mask[:, :4], use_cache=True)
        steps = [out.logits]
        for t in range(4, 12):
            out = ours(
                ids[:, t : t + 1],
                attention_mask=mask[:, : t + 1],
                past_key_values=out.past_key_values,
            )
            steps.append(out.logits)
    keep = mask.bool()
    torch.testing.assert_close(torch.cat(steps, 1)[keep], full[keep], atol=1e-5, rtol=0)


def test_gradients_match(pair: tuple[str, Any, DecoderLM]) -> None:
    name, hf, ours = pair
    ids, mask, pos = _batch()
    # a padded query's logits are arbitrary: no label is predicted from one
    seen = torch.cat((mask[:, :1], mask[:, :-1]), 1)
    labels = ids.masked_fill((mask == 0) | (seen == 0), -100)
    hf.zero_grad()
    ours.zero_grad()
    ref = hf(ids, attention_mask=mask, position_ids=pos, labels=labels).loss
    got = ours(ids, attention_mask=mask, labels=labels).loss
    ref.backward()
    got.backward()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    conv = _converter(hf.config.model_type, name)
    own = dict(ours.named_parameters())
    grads = {theirs: own[mine].grad for mine, theirs in conv.key_map(ours).items() if mine in own}
    if conv.weights_to_hf is not None:  # fused layouts (Phi-3) fuse the gradients alike
        grads = conv.weights_to_hf(grads, ours)
    for theirs, p in hf.named_parameters():
        assert p.grad is not None and grads[theirs] is not None, theirs
        torch.testing.assert_close(grads[theirs], p.grad, atol=1e-4, rtol=0, msg=theirs)


def test_bfloat16_within_the_references_own_error(pair: tuple[str, Any, DecoderLM]) -> None:
    _, hf, ours = pair
    ids, mask, pos = _batch()
    keep = mask.bool()
    with torch.no_grad():
        exact = hf(ids, attention_mask=mask, position_ids=pos).logits[keep]
        theirs = hf.to(torch.bfloat16)(ids, attention_mask=mask, position_ids=pos).logits[keep]
        mine = ours.to(torch.bfloat16)(ids, attention_mask=mask).logits[keep]
    hf.float()
    ours.float()
    # the mean error: the largest of a few hundred roundings is luck of the draw
    ref_err = (theirs.float() - exact).abs().mean()
    our_err = (mine.float() - exact).abs().mean()
    assert our_err <= 2.0 * ref_err, (our_err, ref_err)


SMALL: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
PRESETS: dict[str, tuple[Callable[..., DecoderConfig], str]] = {
    "qwen2": (DecoderConfig.qwen2, "Qwen2ForCausalLM"),
    "qwen3": (DecoderConfig.qwen3, "Qwen3ForCausalLM"),
    "qwen3_moe": (
        lambda **kw: DecoderConfig.qwen3_moe(
            moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=16), **kw
        ),
        "Qwen3MoeForCausalLM",
    ),
    "gemma2": (lambda **kw: DecoderConfig.gemma2(window=4, **kw), "Gemma2ForCausalLM"),
    "gemma3": (lambda **kw: DecoderConfig.gemma3(window=4, **kw), "Gemma3ForCausalLM"),
    "phi3": (DecoderConfig.phi3, "Phi3ForCausalLM"),
    "smollm3": (lambda **kw: DecoderConfig.smollm3(no_rope_every=2, **kw), "SmolLM3ForCausalLM"),
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_convert_to_their_transformers_class(name: str) -> None:
    preset, cls = PRESETS[name]
    torch.manual_seed(0)
    ours = DecoderLM(preset(**SMALL)).eval()
    hf = attnlab.to_hf(ours)
    assert type(hf).__name__ == cls
    ids, _, _ = _batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, atol=1e-5, rtol=0)


def test_local_layers_run_on_a_block_skipping_backend_with_their_window() -> None:
    config = DecoderConfig.gemma2(window=64, **(SMALL | {"num_hidden_layers": 4}))
    model = DecoderLM(config).eval()
    groups = model.explain_attention(torch.zeros(1, 512, dtype=torch.long))
    local, glob = groups
    assert local.layers == (0, 2) and local.window == 64 and glob.window is None
    assert "sliding_window(left=63" in local.pattern and "softcap" in local.pattern
    assert TRAITS[local.explanation.chosen].skips == "pattern"  # the window's tiles only
    assert "layers [0, 2] (window 64)" in str(local)
