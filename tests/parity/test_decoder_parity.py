"""GPT-2, Llama, Mistral, BLOOM and T5 against transformers: logits, greedy generation, round trips.

Random tiny float32 configs; logits within 1e-4, greedy tokens identical for 32 new tokens.
Left-padded batches pass ``position_ids`` to transformers (its plain forward does not
derive them from the mask; attnlab does, as transformers' ``generate`` does).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import attnlab

transformers = pytest.importorskip("transformers")

VOCAB = 64
LLAMA = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    max_position_embeddings=16,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
ROPE = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    },
}


def _llama(rope: str | None = None) -> Callable[[], Any]:
    def build() -> Any:
        kw: dict[str, Any] = dict(LLAMA)
        if rope is not None:
            kw["rope_parameters"] = {**ROPE[rope], "rope_theta": 10000.0}
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))

    return build


BUILDERS: dict[str, Callable[[], Any]] = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )
    ),
    "llama": _llama(),
    "llama_tied": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**(LLAMA | {"tie_word_embeddings": True, "attention_bias": True}))
    ),
    **{f"llama_{k}": _llama(k) for k in ROPE},
    "mistral": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(**(LLAMA | {"max_position_embeddings": 64}), sliding_window=5)
    ),
    "bloom": lambda: transformers.BloomForCausalLM(
        transformers.BloomConfig(
            vocab_size=VOCAB, hidden_size=48, n_layer=2, n_head=6,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )
    ),
}  # fmt: skip


def _hf(name: str) -> Any:
    torch.manual_seed(0)
    model = BUILDERS[name]().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _batch(length: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (3, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :9] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("name", list(BUILDERS))
def test_logits_match_transformers(name: str) -> None:
    hf = _hf(name)
    ours = attnlab.from_hf(hf)
    ids, mask = _batch()
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, position_ids=pos).logits
        got = ours(ids, attention_mask=mask).logits
        keep = mask.bool()
        torch.testing.assert_close(got[keep], ref[keep], atol=1e-4, rtol=0)
        ref_plain = hf(ids[:1]).logits
        torch.testing.assert_close(ours(ids[:1]).logits, ref_plain, atol=1e-4, rtol=0)
    assert ref.abs().max() > 0.1  # a meaningful comparison


@pytest.mark.parametrize("name", list(BUILDERS))
def test_greedy_generation_matches_transformers(name: str) -> None:
    hf = _hf(name)
    ours = attnlab.from_hf(hf)
    ids, mask = _batch(10)
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
    got = ours.generate(ids, 32, attention_mask=mask)
    assert got.shape == ref.shape == (3, 42)
    assert torch.equal(got, ref)


@pytest.mark.slow
def test_compiled_greedy_generation_matches_transformers() -> None:
    """``generate(compile=True)``: the model's decode step compiled over a static cache."""
    hf = _hf("mistral")  # RoPE, GQA, a sliding window and left padding in one model
    ours = attnlab.from_hf(hf)
    ids, mask = _batch(10)
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    got = ours.generate(ids, 12, attention_mask=mask, compile=True)
    assert torch.equal(got, ref)
    again = ours.generate(ids[:, 2:], 12, attention_mask=mask[:, 2:], compile=True)
    assert torch.equal(again, ours.generate(ids[:, 2:], 12, attention_mask=mask[:, 2:]))


@pytest.mark.parametrize("name", ["gpt2", "llama_tied", "llama_yarn", "mistral", "bloom"])
def test_round_trip_to_hf_and_through_a_folder(name: str, tmp_path: Path) -> None:
    hf = _hf(name)
    ours = attnlab.from_hf(hf)
    back = attnlab.to_hf(ours)
    assert type(back) is type(hf)
    ids, _ = _batch(12)
    with torch.no_grad():
        ref = hf(ids).logits
        torch.testing.assert_close(back(ids).logits, ref, atol=1e-5, rtol=0)
    hf.save_pretrained(tmp_path)
    loaded = attnlab.from_hf(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, ref, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- T5

T5_CASES = {
    "t5": dict(feed_forward_proj="relu", num_decoder_layers=3),
    "t5_gated": dict(feed_forward_proj="gated-gelu", num_decoder_layers=2),
}


def _t5(name: str) -> Any:
    torch.manual_seed(0)
    cfg = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=20,
        dropout_rate=0.0, decoder_start_token_id=0, **T5_CASES[name],
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("name", list(T5_CASES))
def test_t5_logits_and_round_trip(name: str, tmp_path: Path) -> None:
    hf = _t5(name)
    ours = attnlab.from_hf(hf)
    ids, mask = _batch(26)
    mask = mask.flip(-1)  # T5 pads on the right
    dec = torch.randint(3, VOCAB, (3, 23), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        got = ours(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
        back = attnlab.to_hf(ours)
        again = back(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        torch.testing.assert_close(again, ref, atol=1e-5, rtol=0)
    hf.save_pretrained(tmp_path)
    with torch.no_grad():
        loaded = attnlab.from_hf(tmp_path)(
            input_ids=ids, attention_mask=mask, decoder_input_ids=dec
        )
    torch.testing.assert_close(loaded.logits, ref, atol=1e-5, rtol=0)


def test_t5_greedy_generation_matches_transformers() -> None:
    hf = _t5("t5_gated")
    ours = attnlab.from_hf(hf)
    ids, mask = _batch(12)
    mask = mask.flip(-1)
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
    got = ours.generate(ids, 32, attention_mask=mask)
    assert torch.equal(got, ref)


def test_eos_stops_each_row_like_transformers() -> None:
    hf = _hf("llama")
    ours = attnlab.from_hf(hf)
    ids, mask = _batch(10)
    # Use a token the model does produce as EOS, so that rows stop at different steps.
    free = ours.generate(ids, 12, attention_mask=mask)[:, 10:]
    eos = int(free[0, 3])
    hf.generation_config.eos_token_id = eos
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    got = ours.generate(ids, 12, attention_mask=mask, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, ref)


def test_unsupported_architecture_is_named() -> None:
    cfg = transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=48,
    )  # fmt: skip
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM"):
        attnlab.from_hf(transformers.GPTNeoXForCausalLM(cfg))
