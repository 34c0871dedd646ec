"""``gradient_checkpointing=True`` gives the same loss and gradients (float32, <= 1e-6),
for every model kind, with dropout on (the recomputation replays the RNG)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from attnlab.models import (
    DecoderConfig,
    DecoderLM,
    EncoderConfig,
    EncoderForMaskedLM,
    Seq2SeqConfig,
    Seq2SeqLM,
)

V = 50


def _decoder(**kw: object) -> nn.Module:
    return DecoderLM(
        DecoderConfig.llama(
            vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, hidden_dropout=0.1, **kw,
        )
    )  # fmt: skip


def _gpt2(**kw: object) -> nn.Module:
    return DecoderLM(
        DecoderConfig.gpt2(
            vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
            intermediate_size=64, hidden_dropout=0.1, attention_dropout=0.1, **kw,
        )
    )  # fmt: skip


def _encoder(**kw: object) -> nn.Module:
    return EncoderForMaskedLM(
        EncoderConfig(
            vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=32, **kw,
        )
    )  # fmt: skip


def _seq2seq(**kw: object) -> nn.Module:
    return Seq2SeqLM(
        Seq2SeqConfig.t5(
            vocab_size=V, d_model=32, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.1,
            relative_attention_num_buckets=8, **kw,
        )
    )  # fmt: skip


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    labels = ids.clone()
    labels[:, ::3] = -100
    return model(input_ids=ids, labels=labels).loss


@pytest.mark.parametrize("build", [_decoder, _gpt2, _encoder, _seq2seq])
def test_checkpointed_gradients_equal(build: Callable[..., nn.Module]) -> None:
    torch.manual_seed(0)
    plain = build().train()
    ckpt = build(gradient_checkpointing=True).train()
    ckpt.load_state_dict(plain.state_dict())
    assert ckpt.config.gradient_checkpointing
    ids = torch.randint(0, V, (2, 16))
    losses, grads = [], []
    for model in (plain, ckpt):
        torch.manual_seed(1)  # same dropout masks
        loss = _loss(model, ids)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=1e-6)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=1e-6, msg=name)


def test_checkpointing_keeps_fewer_tensors_for_the_backward() -> None:
    """Counted with saved_tensors_hooks: only the layer inputs stay, not every intermediate."""
    torch.manual_seed(0)
    counts = []
    for flag in (False, True):
        model = _decoder(gradient_checkpointing=flag).train()
        ids = torch.randint(0, V, (1, 32))
        saved: list[int] = []

        def pack(t: torch.Tensor, saved: list[int] = saved) -> torch.Tensor:
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, labels=ids).loss.backward()
        counts.append(sum(saved))
    assert counts[1] * 2 < counts[0]


def test_checkpointing_is_off_in_eval_and_with_a_cache() -> None:
    torch.manual_seed(0)
    model = _decoder(gradient_checkpointing=True).eval()
    ids = torch.randint(0, V, (1, 8))
    full = model(input_ids=ids).logits
    out = model(input_ids=ids[:, :5], use_cache=True)
    step = model(input_ids=ids[:, 5:], past_key_values=out.past_key_values).logits
    torch.testing.assert_close(step, full[:, 5:], rtol=1e-5, atol=1e-5)
