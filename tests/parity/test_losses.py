"""Losses equal transformers' on the same weights: causal LM (shift, ignore index),
masked LM (BERT's head) and sequence-to-sequence (T5's label shift)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import attnlab
from attnlab.models import EncoderConfig, EncoderForMaskedLM

transformers = pytest.importorskip("transformers")

VOCAB = 64
LLAMA = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    max_position_embeddings=32,
)


def _decoders() -> dict[str, Any]:
    return {
        "gpt2": transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=VOCAB,
                n_embd=32,
                n_layer=2,
                n_head=4,
                n_positions=32,
                bos_token_id=1,
                eos_token_id=2,
            )
        ),
        "llama": transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)),
        "bloom": transformers.BloomForCausalLM(
            transformers.BloomConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                n_layer=2,
                n_head=4,
                bos_token_id=1,
                eos_token_id=2,
                pad_token_id=0,
            )
        ),
    }


@pytest.mark.parametrize("name", ["gpt2", "llama", "bloom"])
def test_causal_lm_loss_equals_transformers(name: str) -> None:
    torch.manual_seed(0)
    hf = _decoders()[name].eval()
    ours = attnlab.from_hf(hf)
    ids = torch.randint(0, VOCAB, (3, 12))
    labels = ids.clone()
    labels[0, :4] = -100  # ignored prompt tokens
    labels[2, -3:] = -100
    want = hf(input_ids=ids, labels=labels).loss
    got = ours(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # and the gradient of the loss
    got.backward()
    want.backward()
    g_ours = ours.embed_tokens.weight.grad
    g_hf = hf.get_input_embeddings().weight.grad
    torch.testing.assert_close(g_ours, g_hf, rtol=1e-4, atol=1e-6)


def test_masked_lm_loss_equals_bert() -> None:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    hf = transformers.BertForMaskedLM(cfg).eval()
    base = attnlab.from_hf(hf.bert)
    ours = EncoderForMaskedLM(EncoderConfig.from_dict(base.config.to_dict())).eval()
    state = {k: v for k, v in base.state_dict().items() if not k.startswith("pooler.")}
    ours.encoder.load_state_dict(state)
    pred = hf.cls.predictions
    with torch.no_grad():
        ours.head.dense.load_state_dict(pred.transform.dense.state_dict())
        ours.head.norm.load_state_dict(pred.transform.LayerNorm.state_dict())
        ours.head.bias.copy_(pred.bias)
    ids = torch.randint(5, VOCAB, (2, 10))
    labels = torch.full_like(ids, -100)
    labels[:, [1, 4, 7]] = ids[:, [1, 4, 7]]
    ids[:, [1, 4, 7]] = 3  # the mask token
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    want = hf(input_ids=ids, attention_mask=mask, labels=labels)
    got = ours(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-5)


def test_seq2seq_loss_equals_t5() -> None:
    torch.manual_seed(0)
    hf = transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=48,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
    ).eval()
    ours = attnlab.from_hf(hf)
    src = torch.randint(2, VOCAB, (2, 9))
    labels = torch.randint(2, VOCAB, (2, 6))
    labels[1, -2:] = -100
    want = hf(input_ids=src, labels=labels).loss
    got = ours(input_ids=src, labels=labels).loss
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_labels_are_checked() -> None:
    torch.manual_seed(0)
    ours = attnlab.from_hf(_decoders()["llama"])
    ids = torch.randint(0, VOCAB, (2, 5))
    with pytest.raises(ValueError, match=r"labels must be \(batch, seq_len\)"):
        ours(input_ids=ids, labels=ids[:, :3])
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        ours(input_ids=ids, labels=ids.float())
