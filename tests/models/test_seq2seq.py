"""Encoder-decoder models: cached decoding equals recomputation, cross-attention cache, errors."""

from __future__ import annotations

import pytest
import torch

from attnlab.models.seq2seq import Seq2SeqLM
from attnlab.models.seq2seq_config import Seq2SeqConfig

SIZES = dict(vocab_size=40, d_model=32, d_ff=48, num_layers=2, num_heads=4)
CONFIGS = {
    "t5": Seq2SeqConfig.t5(**SIZES, relative_attention_num_buckets=8, mlp="gated",
                           dense_act_fn="gelu_new"),
    "transformer": Seq2SeqConfig.transformer(**SIZES, max_position_embeddings=64),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_decoder_steps_equal_full_recomputation(name: str) -> None:
    torch.manual_seed(0)
    model = Seq2SeqLM(CONFIGS[name]).eval()
    src = torch.randint(2, 40, (2, 9))
    src_mask = torch.ones_like(src)
    src_mask[0, 7:] = 0
    dec = torch.randint(2, 40, (2, 8))
    with torch.no_grad():
        full = model(input_ids=src, attention_mask=src_mask, decoder_input_ids=dec).logits
        enc = model.encode(src, attention_mask=src_mask)
        cache = model.new_cache()
        for a, b in [(0, 3)] + [(t, t + 1) for t in range(3, 8)]:
            out = model(
                attention_mask=src_mask,
                decoder_input_ids=dec[:, a:b],
                encoder_outputs=enc,
                past_key_values=cache,
            )
            torch.testing.assert_close(out.logits, full[:, a:b], atol=1e-5, rtol=1e-5)
    assert cache.cross is not None and all(c.filled for c in cache.cross)
    assert cache.length == 8


def test_t5_shares_one_relative_bias_per_stack() -> None:
    model = Seq2SeqLM(CONFIGS["t5"])
    biases = {id(layer.attention.score_bias) for layer in model.encoder_layers}
    assert biases == {id(model.encoder_bias)}
    assert model.decoder_bias is not None and not model.decoder_bias.bidirectional
    assert model.decoder_layers[0].cross_attention.score_bias is None


def test_attention_weights_and_errors() -> None:
    model = Seq2SeqLM(CONFIGS["t5"]).eval()
    src = torch.randint(2, 40, (2, 5))
    dec = torch.randint(2, 40, (2, 4))
    with torch.no_grad():
        out = model(input_ids=src, decoder_input_ids=dec, output_attentions=True)
    assert out.cross_attentions is not None and out.cross_attentions[0].shape == (2, 4, 4, 5)
    assert out.decoder_attentions is not None and bool(
        (out.decoder_attentions[0].triu(1) == 0).all()
    )
    with pytest.raises(ValueError, match="batch sizes differ"):
        model(input_ids=src, decoder_input_ids=dec[:1])
    with pytest.raises(ValueError, match=r"\(2, 5\)"):
        model(input_ids=src, attention_mask=torch.ones(2, 4), decoder_input_ids=dec)
    with pytest.raises(ValueError, match="d_model \\(30\\)"):
        Seq2SeqConfig(d_model=30, num_heads=4)
