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


def test_t5_holds_one_relative_bias_table_per_stack() -> None:
    model = Seq2SeqLM(CONFIGS["t5"])
    tables = [k for k in model.state_dict() if "relative_attention_bias" in k]
    assert tables == [
        "encoder_bias.relative_attention_bias.weight",
        "decoder_bias.relative_attention_bias.weight",
    ]
    assert model.decoder_bias is not None and not model.decoder_bias.bidirectional


@pytest.mark.parametrize("backend", ["auto", "tiled"])
def test_t5_bias_trains_through_the_score_modifier(backend: str) -> None:
    """The learned bias gets the gradient of the dense-bias reference on every path."""
    torch.manual_seed(0)
    src = torch.randint(2, 40, (2, 6))
    mask = torch.ones_like(src)
    mask[1, :2] = 0
    dec = torch.randint(2, 40, (2, 5))
    grads = {}
    for name in ("reference", backend):
        torch.manual_seed(0)
        model = Seq2SeqLM(CONFIGS["t5"], backend=name)
        out = model(input_ids=src, attention_mask=mask, decoder_input_ids=dec)
        out.logits.square().mean().backward()
        assert model.encoder_bias is not None and model.decoder_bias is not None
        grads[name] = [
            b.relative_attention_bias.weight.grad.clone()  # type: ignore[union-attr]
            for b in (model.encoder_bias, model.decoder_bias)
        ]
    for ref, got in zip(grads["reference"], grads[backend], strict=True):
        assert ref.abs().sum() > 0
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


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
