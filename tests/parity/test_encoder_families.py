"""RoBERTa, XLM-RoBERTa, DistilBERT and ModernBERT against transformers 5: one harness.

Tiny random float32 configs, weights drawn wide enough to matter, transformers' eager
attention as the reference: last hidden states of a right-padded batch within 1e-4 (at
the real tokens), ``to_hf`` and a saved folder within 1e-5, the gradient of a loss on the
states within 1e-4 for every weight, bfloat16 within transformers' own bfloat16 error.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import attnlab
from attnlab.interop.hf import _converter
from attnlab.models.encoder import EncoderModel

tf = pytest.importorskip("transformers")

VOCAB = 90
BERTLIKE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=48,
    max_position_embeddings=40,
    pad_token_id=1,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    attn_implementation="eager",
)

CASES: dict[str, Callable[[], Any]] = {
    "roberta": lambda: tf.RobertaModel(tf.RobertaConfig(**BERTLIKE, type_vocab_size=1)),
    "xlm-roberta": lambda: tf.XLMRobertaModel(tf.XLMRobertaConfig(**BERTLIKE, type_vocab_size=1)),
    "distilbert": lambda: tf.DistilBertModel(
        tf.DistilBertConfig(
            vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=48,
            max_position_embeddings=40, dropout=0.0, attention_dropout=0.0, pad_token_id=0,
            attn_implementation="eager",
        )
    ),
    "modernbert": lambda: tf.ModernBertModel(
        tf.ModernBertConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=4,
            num_attention_heads=4, max_position_embeddings=64, pad_token_id=0,
            local_attention=6, global_attn_every_n_layers=3, attn_implementation="eager",
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 160000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        )
    ),
}  # fmt: skip


def _hf(name: str) -> Any:
    torch.manual_seed(0)
    model = CASES[name]().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "LayerNorm" in pname or "layer_norm" in pname or "norm" in pname:
                p.add_(torch.empty_like(p).uniform_(-0.2, 0.2))
            else:
                p.normal_(0, 0.12)
    return model


def _batch(pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (3, 16), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0
    mask[2, 6:] = 0
    return ids.masked_fill(mask == 0, pad), mask


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest) -> tuple[str, Any, EncoderModel]:
    hf = _hf(request.param)
    ours = attnlab.from_hf(hf)
    assert isinstance(ours, EncoderModel)
    return request.param, hf, ours


def test_states_match_with_right_padding(pair: tuple[str, Any, EncoderModel]) -> None:
    _, hf, ours = pair
    ids, mask = _batch(hf.config.pad_token_id)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        got = ours(input_ids=ids, attention_mask=mask).last_hidden_state
    keep = mask.bool()
    torch.testing.assert_close(got[keep], ref[keep], atol=1e-4, rtol=0)
    assert ref.abs().max() > 1.0


def test_round_trip_to_hf_and_through_a_folder(
    pair: tuple[str, Any, EncoderModel], tmp_path: Path
) -> None:
    _, hf, ours = pair
    back = attnlab.to_hf(ours)
    assert type(back) is type(hf)
    ids, mask = _batch(hf.config.pad_token_id)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        again = back(input_ids=ids, attention_mask=mask).last_hidden_state
    keep = mask.bool()  # a padded query's state is arbitrary (eager and sdpa differ there)
    torch.testing.assert_close(again[keep], ref[keep], atol=1e-5, rtol=0)
    hf.save_pretrained(tmp_path)
    loaded = attnlab.from_hf(tmp_path)
    assert loaded.config == ours.config
    with torch.no_grad():
        got = loaded(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got[keep], ref[keep], atol=1e-5, rtol=0)


def test_gradients_match(pair: tuple[str, Any, EncoderModel]) -> None:
    name, hf, ours = pair
    ids, mask = _batch(hf.config.pad_token_id)
    target = torch.randn(3, 16, 32, generator=torch.Generator().manual_seed(4))
    keep = mask.bool()
    hf.zero_grad()
    ours.zero_grad()
    ref = ((hf(input_ids=ids, attention_mask=mask).last_hidden_state - target)[keep] ** 2).mean()
    got = ((ours(input_ids=ids, attention_mask=mask).last_hidden_state - target)[keep] ** 2).mean()
    ref.backward()
    got.backward()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    own = dict(ours.named_parameters())
    conv = _converter(hf.config.model_type, name)
    grads = {theirs: own[mine].grad for mine, theirs in conv.key_map(ours).items() if mine in own}
    if conv.weights_to_hf is not None:  # fused layouts (ModernBERT) fuse the gradients alike
        grads = conv.weights_to_hf(grads, ours)
    for theirs, p in hf.named_parameters():
        if p.grad is None:  # the pooler: not on the loss's path
            assert grads.get(theirs) is None or not grads[theirs].any(), theirs
            continue
        torch.testing.assert_close(grads[theirs], p.grad, atol=1e-4, rtol=0, msg=theirs)


def test_bfloat16_within_the_references_own_error(pair: tuple[str, Any, EncoderModel]) -> None:
    _, hf, ours = pair
    ids, mask = _batch(hf.config.pad_token_id)
    keep = mask.bool()
    with torch.no_grad():
        exact = hf(input_ids=ids, attention_mask=mask).last_hidden_state[keep]
        theirs = hf.to(torch.bfloat16)(input_ids=ids, attention_mask=mask).last_hidden_state
        mine = ours.to(torch.bfloat16)(input_ids=ids, attention_mask=mask).last_hidden_state
    hf.float()
    ours.float()
    ref_err = (theirs[keep].float() - exact).abs().mean()
    our_err = (mine[keep].float() - exact).abs().mean()
    assert our_err <= 2.0 * ref_err, (our_err, ref_err)


@pytest.mark.parametrize("name", ["modernbert", "roberta"])
def test_unpadded_equals_the_padded_reference(name: str) -> None:
    """``unpad=True`` packs the real tokens (a ``document`` pattern, positions restarting
    per row, from ``pad + 1`` for RoBERTa; ModernBERT's local windows inside each row)
    and computes no padding."""
    hf = _hf(name)
    ours = attnlab.from_hf(hf)
    ids, mask = _batch(hf.config.pad_token_id)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        got = ours(input_ids=ids, attention_mask=mask, unpad=True).last_hidden_state
    keep = mask.bool()
    torch.testing.assert_close(got[keep], ref[keep], atol=1e-4, rtol=0)
    assert not got[~keep].any()  # padding computed nowhere: zeros
