"""The paged pool stored in int8/int4, keys per token or per channel over each block: the
storage against a float64 reference, paged decoding equal to the contiguous quantized
cache of the same layout."""

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


def _per_channel_reference(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Float64 KIVI keys: one scale (and minimum) per head and channel over ``x [bs, H, D]``."""
    x = x.double()
    if bits == 8:
        s = x.abs().amax(0, keepdim=True) / 127
        return torch.round(x / s) * s
    lo, hi = x.amin(0, keepdim=True), x.amax(0, keepdim=True)
    s = (hi - lo) / 15
    return torch.round((x - lo) / s) * s + lo


@pytest.mark.parametrize("kv_dtype,bits", [("int8-channel", 8), ("int4-channel", 4)])
def test_per_channel_keys_float_while_a_block_fills_then_per_channel(kv_dtype: str, bits: int) -> None:  # fmt: skip
    torch.manual_seed(1)
    st = KVStorage(num_layers=1, num_kv_heads=2, head_dim=8, num_blocks=4, block_size=4, kv_dtype=kv_dtype)  # fmt: skip
    k, v = torch.randn(4, 2, 8) * torch.tensor([1.0] * 7 + [20.0]), torch.randn(4, 2, 8)
    slots = torch.arange(8, 12)  # block 2
    st.write(0, slots[:3], k[:3], v[:3])
    kr, vr = st.read(0, slots[:3])
    assert torch.equal(kr, k[:3])  # a block being filled keeps its keys in float
    torch.testing.assert_close(vr.double(), _reference(v[:3], bits), rtol=0, atol=1e-5)
    st.copy_blocks([(2, 0)])  # copy-on-write of the partial block
    assert torch.equal(st.read(0, torch.arange(0, 3))[0], k[:3])
    st.write(0, slots[3:], k[3:], v[3:])  # the last slot: quantized per channel
    kr, _ = st.read(0, slots)
    torch.testing.assert_close(kr.double(), _per_channel_reference(k, bits), rtol=0, atol=1e-5)
    assert not torch.equal(kr, k)
    assert st.channel_keys[0].staged_blocks() == 1  # block 0, the copy, still filling
    st.drop_partial([0])
    assert st.channel_keys[0].staged_blocks() == 0
    st.copy_blocks([(2, 3)])  # a full block copies its levels and scales
    assert torch.equal(st.read(0, torch.arange(12, 16))[0], kr)
    st.write(0, torch.tensor([12]), k[:1] * 3, v[:1])  # rewrite into a quantized block
    again = st.read(0, torch.arange(12, 16))[0]
    assert torch.equal(again[0], k[0] * 3) and torch.equal(again[1:], kr[1:])
    # bytes: int levels, a float32 scale (and minimum) per channel per block, values per token
    per_token = KVStorage(num_layers=1, num_kv_heads=2, head_dim=8, num_blocks=4, block_size=4, kv_dtype=kv_dtype[:4])  # fmt: skip
    stats = 2 * 8 * 4 * (1 if bits == 8 else 2)
    assert st.bytes_per_block() == per_token.bytes_per_block() - 4 * 2 * 2 * 4 + stats


@pytest.mark.parametrize("kv_dtype", ["int8-channel", "int4-channel"])
def test_paged_decoding_equals_the_contiguous_per_channel_cache(kv_dtype: str) -> None:
    """KIVI's keys with the block as the group: the contiguous cache with ``group`` the block
    size and no float window beyond the partial group gives the same tokens and logits."""
    model = _model()
    ids = torch.randint(0, 97, (2, 11))  # blocks of 4: the prompt ends in a partial block
    pool = PagedKVPool.for_model(model, num_blocks=16, block_size=4, kv_dtype=kv_dtype)
    paged = model.generate(ids, 8, cache=pool.model_cache())
    bits = kv_dtype[:4]

    def contiguous() -> object:
        cache = model.new_cache()
        cache.layers = [QuantizedKVCache(kv_dtype=bits, key_mode="channel", group=4, residual=0) for _ in cache.layers]  # fmt: skip
        return cache

    assert torch.equal(paged, model.generate(ids, 8, cache=contiguous()))
    pool.reset()
    assert pool.storage.channel_keys[0].staged_blocks() == 0  # reset drops the float copies
    with torch.no_grad():
        a = model(paged[:, :17], past_key_values=pool.model_cache(), use_cache=True).logits
        b = model(paged[:, :17], past_key_values=contiguous(), use_cache=True).logits
        c = model(paged[:, :17]).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert 0 < float((a - c).norm() / c.norm()) < (0.02 if bits == "int8" else 0.2)
