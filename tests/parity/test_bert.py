"""Parity with Hugging Face transformers' BERT: a random tiny config and the real all-MiniLM-L6-v2.

Tolerances (float32): 1e-5 max abs on hidden states and attention weights. On the
real model, positions that are padding in a batch are compared at 1e-4: their states
are not outputs anyone uses, and float32 rounding there is amplified layer by layer
(transformers' own eager and sdpa paths differ by ~1e-5 at those positions; in
float64 attnlab and transformers agree to 1e-12 everywhere, tested below).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import attnlab
from attnlab import backends

transformers = pytest.importorskip("transformers")

SENTENCES = [
    "time flies like an arrow",
    "fruit flies like a banana",
    "attention",
    "the quick brown fox jumps over the lazy dog near the river bank",
]


def _tiny_bert(attn: str = "eager", pooler: bool = True) -> torch.nn.Module:
    cfg = transformers.BertConfig(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=64,
        type_vocab_size=2,
        attn_implementation=attn,
    )
    return transformers.BertModel(cfg, add_pooling_layer=pooler).eval()


def _batch(vocab: int = 99) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (3, 10), generator=g)
    am = torch.tensor([[1] * 10, [1] * 6 + [0] * 4, [1] * 3 + [0] * 7])
    tt = torch.tensor([[0] * 5 + [1] * 5, [0] * 10, [0, 1, 1] + [0] * 7])
    return {"input_ids": ids * am, "attention_mask": am, "token_type_ids": tt}


@pytest.mark.parametrize("pooler", [True, False])
def test_tiny_random_bert(pooler: bool) -> None:
    hf = _tiny_bert(pooler=pooler)
    ours = attnlab.from_hf(hf)
    batch = _batch()
    with torch.no_grad():
        want = hf(**batch, output_attentions=True)
        got = ours(**batch, output_attentions=True)
        fast = ours(**batch)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, atol=1e-5, rtol=0)
    torch.testing.assert_close(fast.last_hidden_state, want.last_hidden_state, atol=1e-5, rtol=0)
    assert len(got.attentions) == 2
    for a, b in zip(got.attentions, want.attentions):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    if pooler:
        torch.testing.assert_close(got.pooler_output, want.pooler_output, atol=1e-5, rtol=0)
    else:
        assert got.pooler_output is None


def test_round_trip_to_hf_and_back() -> None:
    hf = _tiny_bert()
    ours = attnlab.from_hf(hf)
    back = attnlab.to_hf(ours)
    assert type(back).__name__ == "BertModel"
    batch = _batch()
    with torch.no_grad():
        torch.testing.assert_close(
            back(**batch).last_hidden_state, hf(**batch).last_hidden_state, atol=1e-5, rtol=0
        )
        again = attnlab.from_hf(back)
        torch.testing.assert_close(
            again(**batch).last_hidden_state, ours(**batch).last_hidden_state
        )


def test_local_folder_round_trip(tmp_path: Path) -> None:
    hf = _tiny_bert()
    hf.save_pretrained(tmp_path)  # safetensors by default
    ours = attnlab.from_hf(tmp_path)
    batch = _batch()
    with torch.no_grad():
        torch.testing.assert_close(
            ours(**batch).last_hidden_state, hf(**batch).last_hidden_state, atol=1e-5, rtol=0
        )


def test_task_checkpoint_folder_loads_the_encoder(tmp_path: Path) -> None:
    cfg = _tiny_bert().config
    mlm = transformers.BertForMaskedLM(cfg).eval()
    mlm.save_pretrained(tmp_path)
    ours = attnlab.from_hf(tmp_path)
    batch = _batch()
    with torch.no_grad():
        want = mlm.bert(**batch).last_hidden_state
        torch.testing.assert_close(ours(**batch).last_hidden_state, want, atol=1e-5, rtol=0)


def test_unsupported_architectures_are_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "made_up", "architectures": ["MadeUpModel"]})
    )
    with pytest.raises(ValueError, match="unsupported architecture 'MadeUpModel'"):
        attnlab.from_hf(tmp_path)
    mlm = transformers.BertForMaskedLM(_tiny_bert().config)
    with pytest.raises(ValueError, match="unsupported architecture 'BertForMaskedLM'.*BertModel"):
        attnlab.from_hf(mlm)
    with pytest.raises(TypeError, match="transformers model or a local folder"):
        attnlab.from_hf(42)
    with pytest.raises(ValueError, match="has no config.json"):
        attnlab.from_hf(tmp_path / "..")
    relative = transformers.BertConfig(
        vocab_size=10,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=8,
        position_embedding_type="relative_key",
    )
    with pytest.raises(ValueError, match="relative_key"):
        attnlab.from_hf(transformers.BertModel(relative))


def test_folder_without_safetensors_is_refused(tmp_path: Path) -> None:
    _tiny_bert().config.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ValueError, match="safetensors only"):
        attnlab.from_hf(tmp_path)


# ----------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def minilm(minilm_path: Path) -> dict:
    tok = transformers.AutoTokenizer.from_pretrained(minilm_path)
    return {
        "tok": tok,
        "ours": attnlab.from_hf(minilm_path),
        "eager": transformers.BertModel.from_pretrained(
            minilm_path, attn_implementation="eager"
        ).eval(),
        "sdpa": transformers.BertModel.from_pretrained(
            minilm_path, attn_implementation="sdpa"
        ).eval(),
    }


def test_minilm_shape_and_tokens(minilm: dict) -> None:
    ids = minilm["tok"]("time flies like an arrow")["input_ids"]
    assert len(ids) == 7
    ours = minilm["ours"]
    assert ours.config.num_hidden_layers == 6 and ours.config.hidden_size == 384
    assert ours.num_parameters() == sum(p.numel() for p in minilm["eager"].parameters())


@pytest.mark.parametrize("hf_impl", ["eager", "sdpa"])
def test_minilm_one_sentence(minilm: dict, hf_impl: str) -> None:
    batch = minilm["tok"]("time flies like an arrow", return_tensors="pt")
    with torch.no_grad():
        want = minilm[hf_impl](**batch)
        got = minilm["ours"](**batch)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.pooler_output, want.pooler_output, atol=1e-5, rtol=0)


@pytest.mark.parametrize("hf_impl", ["eager", "sdpa"])
def test_minilm_padded_batch(minilm: dict, hf_impl: str) -> None:
    batch = minilm["tok"](SENTENCES, return_tensors="pt", padding=True)
    real = batch["attention_mask"].bool()
    assert (~real).any()  # the batch really is padded
    with torch.no_grad():
        want = minilm[hf_impl](**batch).last_hidden_state
        got = minilm["ours"](**batch).last_hidden_state
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[~real], want[~real], atol=1e-4, rtol=0)


def test_minilm_attention_weights_match_eager(minilm: dict) -> None:
    batch = minilm["tok"](SENTENCES, return_tensors="pt", padding=True)
    with torch.no_grad():
        want = minilm["eager"](**batch, output_attentions=True).attentions
        got = minilm["ours"](**batch, output_attentions=True).attentions
    assert len(got) == 6
    for layer, (a, b) in enumerate(zip(got, want)):
        assert (
            a.shape == b.shape == (4, 12, batch["input_ids"].shape[1], batch["input_ids"].shape[1])
        ), layer
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=f"layer {layer}")


def test_minilm_float64_agrees_everywhere(minilm: dict, minilm_path: Path) -> None:
    batch = minilm["tok"](SENTENCES, return_tensors="pt", padding=True)
    ours = attnlab.from_hf(minilm_path).double()
    hf = (
        transformers.BertModel.from_pretrained(minilm_path, attn_implementation="eager")
        .eval()
        .double()
    )
    with torch.no_grad(), backends.use("reference"):
        torch.testing.assert_close(
            ours(**batch).last_hidden_state, hf(**batch).last_hidden_state, atol=1e-10, rtol=0
        )


def test_minilm_round_trip(minilm: dict) -> None:
    batch = minilm["tok"](SENTENCES, return_tensors="pt", padding=True)
    back = attnlab.to_hf(minilm["ours"])
    with torch.no_grad():
        torch.testing.assert_close(
            back(**batch).last_hidden_state,
            minilm["sdpa"](**batch).last_hidden_state,
            atol=0,
            rtol=0,
        )
