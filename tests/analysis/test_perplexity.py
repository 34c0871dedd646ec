"""Strided sliding-window perplexity against full-sequence losses and a per-token loop."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import attnlab
from attnlab.analysis.perplexity import strided_perplexity, windows
from attnlab.cli.main import main
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig


def _model() -> DecoderLM:
    torch.manual_seed(0)
    config = DecoderConfig.llama(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
    )  # fmt: skip
    return DecoderLM(config).eval()


@pytest.mark.parametrize(
    ("n", "context", "stride"), [(50, 16, 8), (50, 16, 16), (7, 16, 3), (40, 10, 1)]
)
def test_windows_score_each_token_once(n: int, context: int, stride: int) -> None:
    seen: list[int] = []
    for begin, end, first in windows(n, context, stride):
        assert end - begin <= context and begin < first <= end
        seen += list(range(first, end))
    skipped = set(range(0, n, context)) - {0} if stride == context else set()
    assert seen == sorted(set(range(1, n)) - skipped)


def test_one_window_equals_the_full_sequence_loss() -> None:
    model, ids = _model(), torch.randint(0, 64, (40,))
    result = strided_perplexity(model, ids, context=64)
    with torch.no_grad():
        loss = model(input_ids=ids[None], labels=ids[None]).loss
    assert result.windows == 1 and result.tokens == 39
    assert result.perplexity == pytest.approx(math.exp(float(loss)), rel=1e-5)


def test_strided_equals_a_per_token_loop() -> None:
    model, ids = _model(), torch.randint(0, 64, (45,))
    context, stride = 12, 5
    nll = 0.0
    with torch.no_grad():
        for begin, end, first in windows(len(ids), context, stride):
            for t in range(first, end):  # token t from exactly the tokens begin .. t-1
                logits = model(input_ids=ids[None, begin:t]).logits[0, -1]
                nll -= float(torch.log_softmax(logits, -1)[ids[t]])
    result = strided_perplexity(model, ids, context=context, stride=stride)
    assert result.tokens == 44
    assert result.nll == pytest.approx(nll, rel=1e-5)


def test_bad_settings() -> None:
    with pytest.raises(ValueError, match="at least 2 tokens"):
        strided_perplexity(_model(), [3], context=8)
    with pytest.raises(ValueError, match=r"stride \(9\) must be at most context \(8\)"):
        strided_perplexity(_model(), [3, 4, 5], context=8, stride=9)


def test_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    transformers = pytest.importorskip("transformers")
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["the cat sat on the mat"] * 5, vocab_size=270)
    folder = tmp_path / "m"
    torch.manual_seed(0)
    config = DecoderConfig.llama(
        vocab_size=272, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    attnlab.to_hf(DecoderLM(config)).save_pretrained(folder)
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer).save_pretrained(folder)
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat and the dog sat on the log " * 4)
    args = ["perplexity", str(folder), str(text), "--context", "16", "--stride", "8", "--json"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["context"] == 16 and data["stride"] == 8 and data["perplexity"] > 1
    assert data["tokens_per_second"] > 0
    assert main(["perplexity", str(folder), str(text), "--context", "100"]) == 2
    assert "exceeds" in capsys.readouterr().err
    assert main(["perplexity", str(folder), str(tmp_path / "none.txt")]) == 1
    args = [*args, "--kv-dtype", "int4", "--kv-chunk", "4", "--kv-residual", "2"]
    assert main(args) == 0
    kv = json.loads(capsys.readouterr().out)
    assert kv["kv_dtype"] == "int4" and kv["kv_chunk"] == 4 and kv["tokens"] == data["tokens"]


def test_decoding_through_a_float_cache_equals_one_forward() -> None:
    from attnlab.analysis.perplexity import cached_nll
    from attnlab.cache.quantized import quantize_model_cache

    model = _model()
    ids = torch.randint(0, 64, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
    ref = -logp.gather(-1, ids[0, 1:, None])[:, 0]
    for chunk in (1, 4, 29):
        got = cached_nll(model, ids, model.new_cache(), chunk=chunk)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    q = strided_perplexity(
        model, ids[0], context=30, cache=lambda: quantize_model_cache(model.new_cache(), kv_dtype="int2", group=4, residual=4), chunk=4
    )  # fmt: skip
    assert q.tokens == 29 and q.perplexity != pytest.approx(float(ref.mean().exp()), rel=1e-6)
    with pytest.raises(ValueError, match="chunk"):
        cached_nll(model, ids, model.new_cache(), chunk=0)
