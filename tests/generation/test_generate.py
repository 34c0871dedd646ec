"""generate / stream: greedy equals step-by-step argmax, sampling, EOS, streaming, bad input."""

from __future__ import annotations

import pytest
import torch

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
    max_position_embeddings=32,
)


@pytest.fixture(scope="module")
def llama() -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(DecoderConfig.llama(**TINY)).eval()


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 40, (3, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, :4] = 0
    return ids.masked_fill(mask == 0, 0), mask


def test_greedy_equals_argmax_of_full_recomputation(llama: DecoderLM) -> None:
    ids, mask = prompts()
    out = generate(llama, ids, 8, attention_mask=mask)
    seq, m = ids, mask
    with torch.no_grad():
        for _ in range(8):
            nxt = llama(seq, attention_mask=m).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat((seq, nxt), 1)
            m = torch.cat((m, torch.ones_like(nxt)), 1)
    assert torch.equal(out, seq)


def test_stream_yields_the_generated_tokens_one_step_at_a_time(llama: DecoderLM) -> None:
    ids, mask = prompts()
    steps = list(llama.stream(ids, 5, attention_mask=mask))
    assert len(steps) == 5 and all(s.shape == (3,) for s in steps)
    assert torch.equal(torch.stack(steps, 1), llama.generate(ids, 5, attention_mask=mask)[:, 6:])


def test_sampling_is_reproducible_and_top_k_one_is_greedy(llama: DecoderLM) -> None:
    ids, mask = prompts()

    def run(seed: int, **kw: object) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return generate(llama, ids, 10, attention_mask=mask, do_sample=True, generator=g, **kw)  # type: ignore[arg-type]

    assert torch.equal(run(7, temperature=1.5), run(7, temperature=1.5))
    assert not torch.equal(run(7, temperature=5.0), run(8, temperature=5.0))
    greedy = generate(llama, ids, 10, attention_mask=mask)
    assert torch.equal(run(3, top_k=1), greedy)
    assert torch.equal(run(3, top_p=1e-6), greedy)


def test_eos_stops_rows_independently_and_pads_after(llama: DecoderLM) -> None:
    ids, mask = prompts()
    free = generate(llama, ids, 10, attention_mask=mask)[:, 6:]
    eos = int(free[0, 1])
    out = generate(llama, ids, 10, attention_mask=mask, eos_token_id=eos, pad_token_id=0)[:, 6:]
    for row in range(3):
        hits = (free[row] == eos).nonzero()
        if len(hits):
            stop = int(hits[0])
            assert torch.equal(out[row, : stop + 1], free[row, : stop + 1])
            assert bool((out[row, stop + 1 :] == 0).all())
    if all((free[r] == eos).any() for r in range(3)):
        assert out.shape[1] < 10  # every row finished early: generation stopped


def test_encoder_decoder_generation_equals_uncached_argmax() -> None:
    torch.manual_seed(0)
    for cfg in (
        Seq2SeqConfig.t5(vocab_size=40, d_model=32, d_ff=48, num_layers=2, num_heads=4,
                         relative_attention_num_buckets=8, relative_attention_max_distance=16),
        Seq2SeqConfig.transformer(vocab_size=40, d_model=32, d_ff=48, num_layers=2, num_heads=4,
                                  max_position_embeddings=64),
    ):  # fmt: skip
        model = Seq2SeqLM(cfg).eval()
        src = torch.randint(2, 40, (2, 7))
        src_mask = torch.ones_like(src)
        src_mask[1, 5:] = 0
        out = model.generate(src, 6, attention_mask=src_mask)
        assert out.shape == (2, 7)
        dec = out[:, :1]
        with torch.no_grad():
            for _ in range(6):
                logits = model(input_ids=src, attention_mask=src_mask, decoder_input_ids=dec).logits
                dec = torch.cat((dec, logits[:, -1].argmax(-1, keepdim=True)), 1)
        assert torch.equal(out, dec)


def test_bad_input_raises_clear_errors(llama: DecoderLM) -> None:
    ids, mask = prompts()
    with pytest.raises(ValueError, match=r"33 tokens.*max_position_embeddings=32"):
        generate(llama, torch.ones(1, 33, dtype=torch.long), 1)
    with pytest.raises(ValueError, match=r"batch sizes differ.*3.*2"):
        generate(llama, ids, 2, attention_mask=mask[:2])
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        generate(llama, ids, 2, do_sample=True, top_p=1.5)
    with pytest.raises(ValueError, match="top_p"):
        generate(llama, ids, 2, do_sample=True, top_p=0.0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        generate(llama, ids, 2, do_sample=True, temperature=0.0)
    small = llama.new_cache(kind="static", max_length=8)
    with pytest.raises(ValueError, match=r"cache too small.*10 slots"):
        generate(llama, ids, 4, cache=small)
    gpt2 = DecoderLM(DecoderConfig.gpt2(**(TINY | {"num_key_value_heads": 4})))
    with pytest.raises(ValueError, match="exceeds the model's learned positions"):
        generate(gpt2, ids, 30)


def test_static_cache_generation_matches_dynamic(llama: DecoderLM) -> None:
    ids, mask = prompts()
    cache = llama.new_cache(kind="static", max_length=20)
    a = generate(llama, ids, 8, attention_mask=mask, cache=cache)
    assert torch.equal(a, generate(llama, ids, 8, attention_mask=mask))


def test_zero_new_tokens_returns_the_prompt(llama: DecoderLM) -> None:
    ids, _ = prompts()
    assert torch.equal(generate(llama, ids, 0), ids)
    assert list(stream(llama, ids, 0)) == []
