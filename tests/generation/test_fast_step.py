"""The fast decode step gives the modules' logits and tokens (the modules are the reference)."""

from __future__ import annotations

import pytest
import torch

from attnlab.generation import generate
from attnlab.generation.fast_step import FastDecodeStep, fast_step_for
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig

TINY = dict(
    vocab_size=53,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=48,
    max_position_embeddings=24,
)
CONFIGS = {
    "gpt2": DecoderConfig.gpt2(**(TINY | {"max_position_embeddings": 64})),
    "llama_gqa": DecoderConfig.llama(**TINY, num_key_value_heads=2, attention_bias=True),
    "interleaved_mqa": DecoderConfig.llama(
        **TINY, num_key_value_heads=1, rope_convention="interleaved"
    ),
    "dynamic_ntk": DecoderConfig.llama(**TINY, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "yarn": DecoderConfig.llama(
        **TINY, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
    ),
    "bloom": DecoderConfig.bloom(**(TINY | {"num_attention_heads": 6, "hidden_size": 48,
                                            "intermediate_size": 192})),
    "sinusoidal": DecoderConfig.llama(**(TINY | {"max_position_embeddings": 64}),
                                      position_embedding="sinusoidal"),
}  # fmt: skip


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 53, (3, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, :5] = 0
    return ids, mask


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("padded", [False, True])
def test_fast_path_generates_the_same_tokens(name: str, padded: bool) -> None:
    torch.manual_seed(0)
    model = DecoderLM(CONFIGS[name]).eval()
    ids, mask = prompts()
    m = mask if padded else None
    fast = generate(model, ids, 30, attention_mask=m)
    slow = generate(model, ids, 30, attention_mask=m, fast_path=False)
    assert torch.equal(fast, slow)


@pytest.mark.parametrize("name", ["llama_gqa", "bloom", "gpt2"])
def test_fast_step_logits_equal_the_modules(name: str) -> None:
    torch.manual_seed(0)
    model = DecoderLM(CONFIGS[name]).eval()
    ids, mask = prompts()
    seq = torch.cat((ids, torch.randint(1, 53, (3, 5))), 1)
    full_mask = torch.cat((mask, torch.ones(3, 5, dtype=torch.long)), 1)
    with torch.no_grad():
        ref = model(seq, attention_mask=full_mask).logits
        cache = model.new_cache(max_length=12)
        model(ids, attention_mask=mask, past_key_values=cache)
        step = fast_step_for(model, cache)
        assert isinstance(step, FastDecodeStep)
        pos = (full_mask.cumsum(-1) - 1).masked_fill(full_mask == 0, 1)
        for t in range(7, 12):
            got = step(
                seq[:, t : t + 1],
                cache=cache,
                attention_mask=full_mask[:, : t + 1],
                position_ids=pos[:, t : t + 1],
            )
            torch.testing.assert_close(got[:, 0], ref[:, t], atol=1e-5, rtol=1e-5)


def test_fast_path_declines_what_it_does_not_cover() -> None:
    mistral = DecoderLM(DecoderConfig.mistral(**TINY, sliding_window=4)).eval()
    assert fast_step_for(mistral, mistral.new_cache()) is None
    llama = DecoderLM(CONFIGS["llama_gqa"])
    assert fast_step_for(llama, llama.new_cache()) is None  # training mode
    llama.eval()
    assert fast_step_for(llama, llama.new_cache(kind="static", max_length=8)) is None
    assert fast_step_for(llama, llama.new_cache()) is not None


@pytest.mark.parametrize("name", ["llama_gqa", "bloom"])
def test_fast_path_agrees_in_bfloat16(name: str) -> None:
    torch.manual_seed(0)
    model = DecoderLM(CONFIGS[name]).eval().to(torch.bfloat16)
    ids, mask = prompts()
    fast = generate(model, ids, 12, attention_mask=mask)
    slow = generate(model, ids, 12, attention_mask=mask, fast_path=False)
    assert torch.equal(fast, slow)
