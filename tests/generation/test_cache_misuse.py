"""Issue 9, class 5 at the generation entry: a cache left by a stopped stream, pad ids
outside the vocabulary (generated cases)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.generation import generate, stream
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.seq2seq import Seq2SeqLM
from attnlab.models.seq2seq_config import Seq2SeqConfig

TINY = dict(
    vocab_size=40,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def llama() -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(DecoderConfig.llama(**TINY)).eval()


@pytest.fixture(scope="module")
def t5() -> Seq2SeqLM:
    torch.manual_seed(0)
    cfg = Seq2SeqConfig.t5(vocab_size=40, d_model=32, d_kv=8, d_ff=48, num_layers=1, num_heads=4)
    return Seq2SeqLM(cfg).eval()


@pytest.mark.parametrize("kind", ["dynamic", "static"])
@pytest.mark.parametrize("taken", [1, 3])
def test_a_cache_left_by_a_stopped_stream_is_refused_then_reusable_after_reset(
    llama: DecoderLM, kind: str, taken: int
) -> None:
    ids = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(1))
    cache = llama.new_cache(kind=kind, max_length=16)  # type: ignore[arg-type]
    it = stream(llama, ids, 8, cache=cache)
    for _ in range(taken):
        next(it)
    it.close()  # the user stopped reading
    held = cache.length
    assert held == 5 + taken - 1
    with pytest.raises(ValueError, match=rf"cache holds {held} token\(s\).*cache.reset\(\)"):
        generate(llama, ids, 4, cache=cache)
    with pytest.raises(ValueError, match="cache holds"):
        next(stream(llama, ids, 4, cache=cache))
    cache.reset()
    assert torch.equal(generate(llama, ids, 4, cache=cache), generate(llama, ids, 4))


def test_seq2seq_refuses_a_used_cache(t5: Seq2SeqLM) -> None:
    ids = torch.randint(0, 40, (1, 5), generator=torch.Generator().manual_seed(1))
    cache = t5.new_cache(max_length=8)
    it = stream(t5, ids, 4, cache=cache)
    next(it)
    next(it)
    it.close()
    with pytest.raises(ValueError, match="cache holds 2 token"):
        generate(t5, ids, 2, cache=cache)


@settings(max_examples=20, deadline=None)
@given(pad=st.one_of(st.integers(-(10**6), -1), st.integers(40, 10**6)))
def test_pad_token_id_outside_the_vocabulary_is_refused_up_front(
    llama: DecoderLM, pad: int
) -> None:
    ids = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(
        ValueError, match=rf"pad_token_id must lie in \[0, vocab_size=40\), got {pad}"
    ):
        generate(llama, ids, 4, eos_token_id=1, pad_token_id=pad)


def test_pad_token_id_of_the_wrong_type_is_refused(llama: DecoderLM) -> None:
    ids = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(TypeError, match="pad_token_id must be an int token id, got float 2.0"):
        generate(llama, ids, 4, pad_token_id=2.0)  # type: ignore[arg-type]
