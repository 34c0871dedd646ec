"""KV caches: explicit slots, static shapes, bounded sliding windows, errors."""

from __future__ import annotations

import pytest
import torch

from attnlab.cache import (
    CrossAttentionCache,
    DynamicKVCache,
    ModelCache,
    SlidingWindowKVCache,
    StaticKVCache,
)


def kv(n: int, b: int = 2, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    # Values encode their slot so the tests can read which slot a key came from.
    slots = torch.arange(start, start + n, dtype=torch.float32)
    k = slots.view(1, 1, n, 1).expand(b, 2, n, 4).clone()
    return k, -k


def test_static_cache_writes_in_place_and_keeps_its_shape() -> None:
    c = StaticKVCache(max_length=8)
    k, _v = c.update(*kv(3), start=0)
    assert k.shape == (2, 2, 8, 4)
    ptr = k.data_ptr()
    k2, _v2 = c.update(*kv(1, start=3), start=3)
    assert k2.shape == (2, 2, 8, 4) and k2.data_ptr() == ptr
    assert k2[0, 0, :4, 0].tolist() == [0, 1, 2, 3]
    assert c.length == 4
    assert c.key_slots(4, 1).tolist() == [list(range(8))]


def test_static_cache_too_small_raises_with_the_numbers() -> None:
    c = StaticKVCache(max_length=4)
    c.update(*kv(3), start=0)
    with pytest.raises(ValueError, match=r"cache too small.*5.*max_length=4"):
        c.update(*kv(2, start=3), start=3)


def test_cache_batch_mismatch_raises() -> None:
    c = DynamicKVCache()
    c.update(*kv(2, b=2), start=0)
    with pytest.raises(ValueError, match="batch size 3"):
        c.update(*kv(1, b=3, start=2), start=2)


def test_dynamic_cache_grows_and_returns_the_prefix() -> None:
    c = DynamicKVCache(capacity=2)
    c.update(*kv(2), start=0)
    for s in range(2, 9):
        k, v = c.update(*kv(1, start=s), start=s)
    assert k.shape[2] == 9 and k[1, 1, :, 0].tolist() == list(range(9))
    torch.testing.assert_close(v, -k)
    assert c.key_slots(9, 2).tolist() == [list(range(11))]
    with pytest.raises(ValueError, match="next slot is 9"):
        c.update(*kv(1, start=12), start=12)


def test_sliding_window_cache_memory_is_bounded_by_the_window() -> None:
    c = SlidingWindowKVCache(window=4)
    k, _ = c.update(*kv(6), start=0)  # a prompt longer than the window: all keys returned once
    assert k.shape[2] == 6
    for s in range(6, 40):
        slots = c.key_slots(s, 1)
        k, _ = c.update(*kv(1, start=s), start=s)
        assert k[0, 0, :, 0].tolist() == slots[0].tolist()
        assert c.k is not None and c.k.shape[2] <= 4
    assert c.slots is not None and c.slots.tolist() == [36, 37, 38, 39]


def test_cross_attention_cache_and_model_cache() -> None:
    mc = ModelCache.build(3, lambda: DynamicKVCache(), cross=True)
    assert mc.length == 0 and mc.cross is not None and len(mc.cross) == 3
    mc.layers[0].update(*kv(2), start=0)
    assert mc.length == 2
    x = mc.cross[0]
    assert isinstance(x, CrossAttentionCache) and not x.filled
    x.store(*kv(5))
    assert x.filled
    mc.reset()
    assert mc.length == 0 and not x.filled
