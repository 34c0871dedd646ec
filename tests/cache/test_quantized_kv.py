"""The int8/int4 KV cache: per-token quantization, the float window, cut-backs, generate."""

from __future__ import annotations

import pytest
import torch

from attnlab.cache.kv_cache import DynamicKVCache
from attnlab.cache.quantized import QuantizedKVCache
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig


@pytest.mark.parametrize("kv_dtype,tol", [("int8", 0.01), ("int4", 0.1)])
def test_stored_keys_are_within_a_step_and_the_window_is_exact(kv_dtype: str, tol: float) -> None:
    torch.manual_seed(0)
    cache = QuantizedKVCache(kv_dtype=kv_dtype, residual=4)
    k, v = torch.randn(2, 3, 10, 8), torch.randn(2, 3, 10, 8)
    ko, vo = cache.update(k, v, start=0)
    torch.testing.assert_close(ko[:, :, 6:], k[:, :, 6:], rtol=0, atol=0)  # the float window
    rel = (ko[:, :, :6] - k[:, :, :6]).abs().amax() / k.abs().amax()
    assert 0 < float(rel) < tol
    k2, v2 = torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8)
    ko, vo = cache.update(k2, v2, start=10)
    assert ko.shape == (2, 3, 11, 8) and torch.equal(vo[:, :, 10:], v2)
    # bytes at equal capacity and a real head dim: levels + one scale per token, and the window
    big, dense = (
        QuantizedKVCache(kv_dtype=kv_dtype, residual=4, capacity=256),
        DynamicKVCache(capacity=256),
    )
    x = torch.randn(1, 3, 256, 64)
    big.update(x, x, start=0)
    dense.update(x, x, start=0)
    ratio = big.nbytes() / dense.nbytes()
    assert ratio < (0.3 if kv_dtype == "int8" else 0.18), ratio


def test_cut_back_and_rewrite() -> None:
    cache = QuantizedKVCache(residual=3)
    k = torch.randn(1, 2, 6, 4)
    cache.update(k, k, start=0)
    cache.length = 4  # drop slots 4 and 5 (speculative decoding's cut-back)
    new = torch.randn(1, 2, 2, 4)
    ko, _ = cache.update(new, new, start=4)
    assert torch.equal(ko[:, :, 4:], new)
    torch.testing.assert_close(ko[:, :, 3], k[:, :, 3], rtol=0, atol=0)  # still in the window


def test_generate_with_a_quantized_cache_is_close_to_float() -> None:
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=64)).eval()  # fmt: skip
    ids = torch.randint(0, 64, (2, 40))
    plain = model.generate(ids, 6)
    q8 = model.generate(ids, 6, kv_dtype="int8")
    assert q8.shape == plain.shape
    assert (q8 == plain).float().mean() > 0.9
    cache = model.new_cache()
    cache.layers = [QuantizedKVCache(kv_dtype="int8", residual=0) for _ in cache.layers]
    with torch.no_grad():
        a = model(ids).logits
        b = model(ids, past_key_values=cache, use_cache=True).logits
    assert float((a - b).norm() / a.norm()) < 0.02
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        model.generate(ids, 2, kv_dtype="fp8")
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        QuantizedKVCache(kv_dtype="int2")
