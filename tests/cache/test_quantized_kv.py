"""The int8/int4/int2 KV cache (KIVI): keys per channel or per token, values per token,
the float window, streaming equals one-shot writes, cut-backs, generate."""

from __future__ import annotations

import pytest
import torch

from attnlab.cache.kv_cache import DynamicKVCache
from attnlab.cache.quantized import QuantizedKVCache, _pack, _unpack, kv_bytes_per_token
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig

BITS = {"int8": 8, "int4": 4, "int2": 2}


@pytest.mark.parametrize("bits", [2, 4])
def test_pack_round_trip(bits: int) -> None:
    q = torch.randint(0, 1 << bits, (3, 5, 16), dtype=torch.uint8)
    p = _pack(q, bits)
    assert p.shape == (3, 5, 16 * bits // 8)
    assert torch.equal(_unpack(p, bits), q)


def _reference(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """float64 round-to-nearest over slices along ``dim`` (the paper's equations)."""
    x = x.double()
    if bits == 8:
        s = x.abs().amax(dim, keepdim=True) / 127
        return torch.round(x / s) * s
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    s = (hi - lo) / ((1 << bits) - 1)
    return torch.round((x - lo) / s) * s + lo


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "int2"])
@pytest.mark.parametrize("key_mode", ["channel", "token"])
def test_stored_values_match_a_float64_reference_and_the_window_is_exact(
    kv_dtype: str, key_mode: str
) -> None:
    torch.manual_seed(0)
    b, h, n, d, g, r = 2, 3, 77, 16, 8, 5
    k, v = torch.randn(b, h, n, d), torch.randn(b, h, n, d)
    cache = QuantizedKVCache(kv_dtype=kv_dtype, key_mode=key_mode, group=g, residual=r)
    ko, vo = cache.update(k, v, start=0)
    bits = BITS[kv_dtype]
    # keys: whole groups of g leave the window (channel mode), tokens one by one otherwise
    ks = (n - r) // g * g if key_mode == "channel" else n - r
    vs = n - r
    assert torch.equal(ko[:, :, ks:], k[:, :, ks:]) and torch.equal(vo[:, :, vs:], v[:, :, vs:])
    if key_mode == "channel":
        ref_k = _reference(k[:, :, :ks].reshape(b, h, ks // g, g, d), bits, 3).reshape(b, h, ks, d)
    else:
        ref_k = _reference(k[:, :, :ks], bits, -1)
    ref_v = _reference(v[:, :, :vs], bits, -1)
    # rounding ties may differ by float32 arithmetic: compare within a hundredth of a step
    step = (k.amax() - k.amin()) / ((1 << bits) - 1)
    torch.testing.assert_close(ko[:, :, :ks].double(), ref_k, rtol=0, atol=float(step) * 1e-2)
    torch.testing.assert_close(vo[:, :, :vs].double(), ref_v, rtol=0, atol=float(step) * 1e-2)
    assert not torch.equal(ko[:, :, :ks], k[:, :, :ks])


@pytest.mark.parametrize("key_mode", ["channel", "token"])
def test_token_by_token_equals_one_write(key_mode: str) -> None:
    torch.manual_seed(1)
    k, v = torch.randn(1, 2, 50, 8), torch.randn(1, 2, 50, 8)
    one = QuantizedKVCache(kv_dtype="int4", key_mode=key_mode, group=4, residual=6)
    ko, vo = one.update(k, v, start=0)
    step = QuantizedKVCache(kv_dtype="int4", key_mode=key_mode, group=4, residual=6, capacity=3)
    for t in range(0, 50, 3):
        ks, vs = step.update(k[:, :, t : t + 3], v[:, :, t : t + 3], start=t)
    assert torch.equal(ks, ko) and torch.equal(vs, vo)
    assert one.nbytes() > 0 and step.length == 50


def test_keys_per_channel_survive_an_outlier_channel_at_two_bits() -> None:
    """KIVI's observation, by construction: one channel 20x larger than the others ruins a
    per-token scale and leaves a per-channel one untouched."""
    torch.manual_seed(2)
    k = torch.randn(1, 1, 64, 32)
    k[..., 5] *= 20
    err = {}
    for mode in ("channel", "token"):
        c = QuantizedKVCache(kv_dtype="int2", key_mode=mode, group=32, residual=0)
        ko, _ = c.update(k, k, start=0)
        err[mode] = float((ko - k)[..., torch.arange(32) != 5].pow(2).mean())
    assert err["channel"] * 10 < err["token"], err


def test_cut_back_and_rewrite() -> None:
    k = torch.randn(1, 2, 6, 4)
    cache = QuantizedKVCache(key_mode="token", residual=3)
    cache.update(k, k, start=0)
    cache.length = 4  # drop slots 4 and 5 (speculative decoding's cut-back)
    new = torch.randn(1, 2, 2, 4)
    ko, _ = cache.update(new, new, start=4)
    assert torch.equal(ko[:, :, 4:], new)
    torch.testing.assert_close(ko[:, :, 3], k[:, :, 3], rtol=0, atol=0)  # still in the window
    # a cut into a stored key group keeps the group's stored approximation
    k = torch.randn(1, 2, 20, 4)
    cache = QuantizedKVCache(kv_dtype="int4", group=4, residual=2)
    before, _ = cache.update(k, k, start=0)  # keys 0..15 stored, 16..19 float
    cache.length = 10
    new = torch.randn(1, 2, 1, 4)
    after, _ = cache.update(new, new, start=10)
    assert after.shape[2] == 11
    assert torch.equal(after[:, :, :10], before[:, :, :10]) and torch.equal(after[:, :, 10:], new)


def test_bytes_per_token() -> None:
    x = torch.randn(1, 3, 256, 64)
    dense = DynamicKVCache(capacity=256)
    dense.update(x, x, start=0)
    for kv_dtype, most in (("int8", 0.3), ("int4", 0.18), ("int2", 0.11)):
        big = QuantizedKVCache(kv_dtype=kv_dtype, residual=0, capacity=256)
        big.update(x, x, start=0)
        assert big.nbytes() / dense.nbytes() < most
        per = kv_bytes_per_token(kv_dtype, 64)
        assert big.nbytes() == pytest.approx(3 * 256 * per)


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
        QuantizedKVCache(kv_dtype="int3")
    with pytest.raises(ValueError, match="key_mode must be one of"):
        QuantizedKVCache(key_mode="head")
    with pytest.raises(ValueError, match="head dims must be multiples of 4"):
        QuantizedKVCache(kv_dtype="int2").update(
            torch.randn(1, 1, 2, 6), torch.randn(1, 1, 2, 6), start=0
        )
