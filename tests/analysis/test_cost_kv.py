"""The cost model counts a quantized KV cache's bytes as QuantizedKVCache holds them."""

from __future__ import annotations

import pytest
import torch

from attnlab.analysis.cost import estimate
from attnlab.cache.quantized import quantize_model_cache
from attnlab.cli.main import main
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "int2"])
def test_estimate_matches_the_cache_after_a_prefill(kv_dtype: str) -> None:
    torch.manual_seed(0)
    config = DecoderConfig.llama(
        vocab_size=64, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=1024,
    )  # fmt: skip
    model = DecoderLM(config).eval()
    n = 511
    cache = quantize_model_cache(model.new_cache(), kv_dtype=kv_dtype, capacity=n + 1)
    ids = torch.randint(0, 64, (1, n + 1))
    with torch.no_grad():  # a prefill of n tokens, then the decoding step the estimate costs
        model(ids[:, :n], past_key_values=cache, use_cache=True)
        model(ids[:, n:], past_key_values=cache, use_cache=True)
    got = estimate(config, seq_len=n, mode="decode", kv_dtype=kv_dtype).kv_cache_bytes
    dense = estimate(config, seq_len=n, mode="decode").kv_cache_bytes
    assert got == cache.nbytes()
    # 512 tokens, 64-95 of them in the float window
    assert got < dense * {"int8": 0.35, "int4": 0.25, "int2": 0.2}[kv_dtype]


def test_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    config = DecoderConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)  # fmt: skip
    with pytest.raises(ValueError, match="applies to mode='decode'"):
        estimate(config, seq_len=8, kv_dtype="int8")
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        estimate(config, seq_len=8, mode="decode", kv_dtype="fp8")
    assert estimate(config, seq_len=8, mode="decode", kv_dtype="float").kv_cache_bytes > 0
    assert main(["estimate", "--kv-dtype", "int4"]) == 2
    assert "--seq-len and --mode decode" in capsys.readouterr().err
    assert main(["estimate", "--seq-len", "64", "--mode", "decode", "--kv-dtype", "int4"]) == 0
    assert "KV cache in int4" in capsys.readouterr().out
