"""The chunked causal-LM loss (no ``[B, L, V]`` logits held) equals the plain one (both in
float32, summed in another order): value and gradients, with ignored labels, soft-capped
heads, tied embeddings and bfloat16 autocast; a decoder's ``return_logits=False`` gives
the same loss and gradients."""

from __future__ import annotations

import pytest
import torch

from attnlab.functional.losses import causal_lm_loss, chunked_causal_lm_loss
from attnlab.models import DecoderConfig, DecoderLM


def _case(seed: int = 0) -> tuple[torch.Tensor, torch.nn.Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 11, 8, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(8, 37, dtype=torch.float64)
    labels = torch.randint(0, 37, (3, 11), generator=g)
    labels[0, :4] = -100  # a prompt
    labels[2, 7:] = -100
    return hidden, head, labels


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_loss_equals_the_full_logits_loss_and_its_gradients(chunk):
    hidden, head, labels = _case()
    ref = causal_lm_loss(head(hidden), labels)
    ref_grads = torch.autograd.grad(ref, [hidden, head.weight, head.bias])
    got = chunked_causal_lm_loss(hidden, head, labels, vocab_size=37, chunk_tokens=chunk)
    got_grads = torch.autograd.grad(got, [hidden, head.weight, head.bias])
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    for a, b in zip(got_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_chunked_loss_with_a_soft_capped_head_and_without_gradients():
    hidden, head, labels = _case(1)

    def capped(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(head(x) / 3.0) * 3.0

    ref = causal_lm_loss(capped(hidden), labels)
    with torch.no_grad():
        got = chunked_causal_lm_loss(hidden, capped, labels, vocab_size=37, chunk_tokens=4)
    torch.testing.assert_close(got, ref.detach(), rtol=1e-6, atol=1e-7)


def test_chunked_loss_refuses_bad_arguments():
    hidden, head, labels = _case()
    with pytest.raises(ValueError, match="labels must be"):
        chunked_causal_lm_loss(hidden, head, labels[:, :-1], vocab_size=37)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_causal_lm_loss(hidden, head, labels, vocab_size=37, chunk_tokens=0)
    with pytest.raises(TypeError, match="labels"):
        chunked_causal_lm_loss(hidden, head, labels.float(), vocab_size=37)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_decoder_without_logits_gives_the_same_loss_and_gradients(tied, checkpointing):
    torch.manual_seed(0)
    cfg = DecoderConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=24, max_position_embeddings=32, tie_word_embeddings=tied,
        gradient_checkpointing=checkpointing,
    )  # fmt: skip
    model = DecoderLM(cfg).double().train()
    ids = torch.randint(0, 50, (2, 12))
    labels = ids.clone()
    labels[:, :5] = -100
    params = [p for p in model.parameters() if p.requires_grad]
    ref = model(input_ids=ids, labels=labels).loss
    ref_grads = torch.autograd.grad(ref, params)
    out = model(input_ids=ids, labels=labels, return_logits=False)
    assert out.logits is None
    got_grads = torch.autograd.grad(out.loss, params)
    torch.testing.assert_close(out.loss, ref, rtol=1e-6, atol=1e-7)
    for a, b in zip(got_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the float32 loss of bf16 logits
        m32 = model.float()
        a = m32(input_ids=ids, labels=labels).loss
        b = m32(input_ids=ids, labels=labels, return_logits=False).loss
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="return_logits=False needs labels"):
        model(input_ids=ids, return_logits=False)
