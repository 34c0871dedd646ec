"""The paged pool stored in int8/int4 (per token): the storage against a float64 reference,
paged decoding equal to the contiguous per-token-quantized cache, the engine's kv_dtype."""

from __future__ import annotations

import pytest
import torch

from attnlab.cache import PagedKVPool
from attnlab.cache.paged.storage import KVStorage
from attnlab.cache.quantized import QuantizedKVCache
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig


def _reference(x: torch.Tensor, bits: int) -> torch.Tensor:
    x = x.double()
    if bits == 8:
        s = x.abs().amax(-1, keepdim=True) / 127
        return torch.round(x / s) * s
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    s = (hi - lo) / 15
    return torch.round((x - lo) / s) * s + lo


@pytest.mark.parametrize("kv_dtype,bits", [("int8", 8), ("int4", 4)])
def test_storage_round_trip_copy_and_bytes(kv_dtype: str, bits: int) -> None:
    torch.manual_seed(0)
    st = KVStorage(num_layers=2, num_kv_heads=3, head_dim=16, num_blocks=4, block_size=4, kv_dtype=kv_dtype)  # fmt: skip
    k, v = torch.randn(6, 3, 16), torch.randn(6, 3, 16)
    slots = torch.tensor([0, 1, 2, 3, 9, 10])
    st.write(1, slots, k, v)
    kr, vr = st.read(1, slots)
    step = float(k.abs().amax()) / (127 if bits == 8 else 7.5)
    torch.testing.assert_close(kr.double(), _reference(k, bits), rtol=0, atol=step * 1e-2)
    torch.testing.assert_close(vr.double(), _reference(v, bits), rtol=0, atol=step * 1e-2)
    st.copy_blocks([(0, 3)])  # block 0 (slots 0..3) onto block 3 (slots 12..15)
    k3, _ = st.read(1, torch.arange(12, 16))
    assert torch.equal(k3, kr[:4])
    dense = KVStorage(num_layers=2, num_kv_heads=3, head_dim=16, num_blocks=4, block_size=4)
    assert st.bytes_per_block() == dense.bytes_per_block() * (bits / 32 + 8 / 64)
    with pytest.raises(TypeError, match="paged pool holds torch.float32"):
        st.write(0, slots, k.double(), v.double())
    with pytest.raises(ValueError, match="kv_dtype of a paged pool must be None or one of"):
        KVStorage(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=1, block_size=1, kv_dtype="int2")  # fmt: skip


def _model() -> DecoderLM:
    torch.manual_seed(0)
    config = DecoderConfig.llama(
        vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
    )  # fmt: skip
    return DecoderLM(config).eval()


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_paged_decoding_equals_the_contiguous_per_token_cache(kv_dtype: str) -> None:
    """Both quantize each token's key and value per head over the head dim, with no float
    window: the same numbers through another layout."""
    model = _model()
    ids = torch.randint(0, 97, (2, 11))
    pool = PagedKVPool.for_model(model, num_blocks=16, block_size=4, kv_dtype=kv_dtype)
    assert pool.layers[0].block_size == 0  # read by gathering only
    paged = model.generate(ids, 8, cache=pool.model_cache())
    cache = model.new_cache()
    cache.layers = [QuantizedKVCache(kv_dtype=kv_dtype, key_mode="token", residual=0) for _ in cache.layers]  # fmt: skip
    assert torch.equal(paged, model.generate(ids, 8, cache=cache))
    pool.reset()
    with torch.no_grad():
        a = model(ids, past_key_values=pool.model_cache(), use_cache=True).logits
        b = model(ids).logits
    assert 0 < float((a - b).norm() / b.norm()) < (0.02 if kv_dtype == "int8" else 0.2)
