"""The cache protocol (docs/contracts.md section 2): length, reset, select, nbytes, key slots,
tensor starts, and the bad-input class of issue 9 for caches (generated cases)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.cache import (
    CrossAttentionCache,
    DynamicKVCache,
    KVCache,
    LayerCache,
    ModelCache,
    SlidingWindowKVCache,
    StaticKVCache,
)

MAKERS: dict[str, Callable[[], KVCache]] = {
    "static": lambda: StaticKVCache(max_length=16),
    "dynamic": lambda: DynamicKVCache(),
    "sliding": lambda: SlidingWindowKVCache(window=4),
}


def kv(n: int, b: int = 2, h: int = 2, d: int = 4, start: int = 0, dtype=torch.float32):
    # Values encode (row, slot) so a test can read where a key came from.
    slots = torch.arange(start, start + n, dtype=dtype).view(1, 1, n, 1)
    rows = torch.arange(b, dtype=dtype).view(b, 1, 1, 1) * 100
    k = (slots + rows).expand(b, h, n, d).clone()
    return k, -k


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_every_kv_cache_is_a_layer_cache_with_the_protocol(kind: str) -> None:
    c = MAKERS[kind]()
    assert isinstance(c, LayerCache) and c.length == 0 and c.nbytes() == 0
    c.update(*kv(3), start=0)
    slots = c.key_slots(3, 1)  # the slots the next update returns, in its order
    assert slots.dim() == 2 and slots.shape[0] == 1
    k, _ = c.update(*kv(1, start=3), start=3)
    assert c.length == 4 and k.shape[2] == slots.shape[1]
    # Every returned key holds the slot key_slots named (unwritten static slots are 0).
    written = slots[0] < 4
    assert k[0, 0, written, 0].tolist() == slots[0, written].float().tolist()
    assert c.nbytes() >= 2 * 2 * 2 * 4 * 4 * min(4, getattr(c, "window", 4))
    c.select(torch.tensor([1, 1, 0]))
    k2, _ = c.update(*kv(1, b=3, start=4), start=4)
    # Row 0 now holds the old row 1's keys; row 2 the old row 0's.
    assert k2[0, 0, 3, 0].item() == 103.0 and k2[2, 0, 3, 0].item() == 3.0
    c.reset()
    assert c.length == 0


def test_model_cache_mixes_kinds_and_sums_bytes() -> None:
    mc = ModelCache(layers=[StaticKVCache(max_length=8), DynamicKVCache(), CrossAttentionCache()])
    for layer in mc.layers[:2]:
        assert isinstance(layer, KVCache)
        layer.update(*kv(3), start=0)
    cross = mc.layers[2]
    assert isinstance(cross, CrossAttentionCache)
    cross.store(*kv(5))
    assert mc.length == 5  # the most over layers (the cross cache holds 5 encoder keys)
    assert mc.nbytes() == sum(c.nbytes() for c in mc.layers) > 0
    mc.select(torch.tensor([1]))
    assert cross.key is not None and cross.key.shape[0] == 1
    mc.reset()
    assert (
        mc.length == 0
        and mc.nbytes() == StaticKVCache(max_length=8).nbytes() + mc.layers[0].nbytes()
    )
    mc.set_length(3)
    assert all(c.length == 3 for c in mc.layers)


def test_static_cache_writes_at_tensor_positions_without_moving_length() -> None:
    c = StaticKVCache(max_length=8)
    c.update(*kv(2), start=0)
    k, _ = c.update(*kv(1, start=2), start=torch.tensor(2))  # 0-d: a compiled step's position
    assert k[1, 1, :3, 0].tolist() == [100.0, 101.0, 102.0]
    assert c.length == 2  # the caller advances it (ModelCache.set_length)
    # Per-row starts: row 0 writes slot 3, row 1 slot 5.
    new_k, new_v = kv(1, start=7)
    k, v = c.update(new_k, new_v, start=torch.tensor([3, 5]))
    assert k[0, 0, 3, 0].item() == 7.0 and k[1, 0, 5, 0].item() == 107.0
    assert k[0, 0, 5, 0].item() == 0.0 and v[1, 1, 5, 0].item() == -107.0


def test_aligned_caches_refuse_per_row_starts() -> None:
    c = DynamicKVCache()
    with pytest.raises(ValueError, match=r"same slot.*\[0, 2\].*StaticKVCache"):
        c.update(*kv(1), start=torch.tensor([0, 2]))
    c.update(*kv(1), start=torch.tensor([0, 0]))
    assert c.length == 1


# --------------------------------------------------------------- issue 9, class 5


@settings(max_examples=30, deadline=None)
@given(
    kind=st.sampled_from(sorted(MAKERS)),
    change=st.sampled_from(["heads", "head_dim", "value_dim", "batch"]),
    delta=st.integers(1, 3),
)
def test_a_shape_change_between_updates_names_both_shapes(
    kind: str, change: str, delta: int
) -> None:
    c = MAKERS[kind]()
    c.update(*kv(2), start=0)
    b, h, d = 2, 2, 4
    if change == "batch":
        b += delta
    elif change == "heads":
        h += delta
    elif change == "head_dim":
        d += delta
    k, v = kv(1, b=b, h=h, d=d, start=2)
    if change == "value_dim":
        v = torch.cat((v, v[..., :delta]), dim=-1)
    with pytest.raises(ValueError) as err:
        c.update(k, v, start=2)
    msg = str(err.value)
    if change == "batch":
        assert f"batch size {b}" in msg and "batch size 2" in msg
    else:
        assert "2 key/value heads of dims 4/4" in msg and "reset()" in msg
    assert c.length == 2  # nothing was written


@settings(max_examples=30, deadline=None)
@given(
    cache_dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    scale=st.floats(1.01, 1e30),
    kind=st.sampled_from(["static", "dynamic", "sliding"]),
)
def test_values_beyond_the_cache_dtype_are_refused_not_stored_as_inf(
    cache_dtype: torch.dtype, scale: float, kind: str
) -> None:
    limit = torch.finfo(cache_dtype).max
    c: KVCache
    if kind == "static":
        c = StaticKVCache(max_length=8, batch_size=2, num_kv_heads=2, head_dim=4, dtype=cache_dtype)
    else:
        c = MAKERS[kind]()
        c.update(*kv(1, dtype=cache_dtype), start=0)
    start = c.length
    k, v = kv(1, start=start, dtype=torch.float64)
    k[0, 1, 0, 2] = limit * scale  # float64 holds it; the cache's dtype does not
    with pytest.raises(
        ValueError, match=rf"key has values up to .*beyond the cache's dtype {cache_dtype}"
    ):
        c.update(k, v, start=start)
    # Values that fit are accepted (and rounded), and infinities already in the input
    # are the input's, not an overflow.
    k[0, 1, 0, 2] = float("inf")
    out, _ = c.update(k, v, start=start)
    assert out.dtype == cache_dtype


def test_bad_rows_for_select_are_named() -> None:
    c = DynamicKVCache()
    c.update(*kv(1), start=0)
    with pytest.raises(
        ValueError, match=r"rows must lie in \[0, batch_size=2\), got range \[0, 2\]"
    ):
        c.select(torch.tensor([0, 2]))
    with pytest.raises(TypeError, match="rows must be a 1-D integer tensor"):
        c.select([0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rows must be a 1-D integer tensor"):
        c.select(torch.tensor([0.0]))
