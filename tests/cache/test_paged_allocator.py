"""Block allocator and paged pool: invariants under a 100k-operation fuzz against a simple model."""

from __future__ import annotations

import random

import pytest
import torch

from attnlab.cache import BlockAllocator, OutOfBlocks, PagedKVPool
from attnlab.cache.paged import block_hash
from attnlab.cache.paged.manager import FREED, KVManager


def test_allocator_states_and_lru_eviction() -> None:
    a = BlockAllocator(num_blocks=3)
    b0, b1, b2 = a.allocate(), a.allocate(), a.allocate()
    with pytest.raises(OutOfBlocks, match="all 3 KV blocks"):
        a.allocate()
    h0, h1 = block_hash(None, [1, 2]), block_hash(None, [3, 4])
    assert a.register(b0, h0) and a.register(b1, h1)
    assert not a.register(b2, h0)  # the content is cached already
    a.release(b1)
    a.release(b0)  # b1 was released first: it is evicted first
    assert a.num_free == 2 and a.num_evictable == 2
    assert a.lookup(h0) == b0 and a.refcount(b0) == 1
    assert a.allocate() == b1 and a.evictions == 1
    assert a.lookup(h1) is None
    a.check()
    with pytest.raises(ValueError, match="not held"):
        a.release(b2) or a.release(b2)


def test_block_hash_chains_the_prefix() -> None:
    first = block_hash(None, [1, 2, 3, 4])
    assert block_hash(first, [5, 6]) != block_hash(block_hash(None, [9, 9, 9, 9]), [5, 6])
    assert block_hash(first, [5, 6]) == block_hash(block_hash(None, [1, 2, 3, 4]), [5, 6])


def test_pool_errors_name_the_values() -> None:
    with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
        PagedKVPool(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=2, block_size=0)
    pool = PagedKVPool(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=2, block_size=2)
    pool.add_sequence("a", [1, 2, 3])
    with pytest.raises(ValueError, match="already exists"):
        pool.add_sequence("a", [1])
    with pytest.raises(OutOfBlocks, match="needs 3 block"):
        pool.reserve("a", 5)
    assert pool.num_used_blocks == 0  # all or nothing
    with pytest.raises(ValueError, match="unknown sequence 'b'"):
        pool.free("b")


class _Model:
    """What the pool should hold: each sequence's token list and how much of it is stored."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.stored: dict[int, int] = {}


def _write_and_read(pool: PagedKVPool, rows: list[tuple[int, int]]) -> dict[int, list[float]]:
    """Run one step whose keys are the token ids; return what each row reads back."""
    step = pool.begin_step(rows)
    b, width = step.input_ids.shape
    key = step.input_ids.to(torch.float32).view(b, 1, width, 1)  # [B, 1, L, 1]
    keys, _ = pool.layers[0].update(key, -key, start=step.start)
    pool.end_step()
    out: dict[int, list[float]] = {}
    for r, (sid, _n) in enumerate(rows):
        total = pool.num_computed(sid)
        out[sid] = keys[r, 0, keys.shape[2] - total :, 0].tolist()
    return out


OPS = 100_000


def _stored_slots(m: KVManager) -> int:
    """Filled slots of the held blocks, block by block (a shared block counted once)."""
    fill: dict[int, int] = {}
    for s in m.seqs.values():
        for i, blk in enumerate(s.blocks):
            n = min(m.block_size, max(0, s.computed - i * m.block_size))
            if blk != FREED and n >= fill.get(blk, 0):
                fill[blk] = n
    return sum(fill.values())


def test_pool_fuzz_100k_operations() -> None:
    """100k random add/append/write/fork/free/evict operations through the public API.

    Checked against a simple model (each sequence's tokens and how many are stored):
    reference counts equal the number of block tables holding the block and no block is
    lost (checked every few operations); every write step reads back exactly each row's
    tokens, so no block shared with another sequence was written; at the end every
    block is free again.
    """
    rng = random.Random(0)
    bs = 4
    pool = PagedKVPool(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=20, block_size=bs)
    model = _Model()
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(1, 13))] for _ in range(5)]
    next_id = 0
    steps = 0
    for ops in range(OPS):
        op = rng.random()
        live = list(model.tokens)
        if len(live) > 8:
            op = 0.9  # free
        if op < 0.12 or not live:  # add a sequence, often sharing a cached prefix
            tokens = list(rng.choice(prefixes))
            tokens += [rng.randrange(1, 50) for _ in range(rng.randrange(0, 6))]
            cached = pool.add_sequence(next_id, tokens)
            assert cached % bs == 0 and cached < len(tokens)
            model.tokens[next_id], model.stored[next_id] = tokens, cached
            next_id += 1
        elif op < 0.52:  # append known tokens
            sid = rng.choice(live)
            extra = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 4))]
            pool.append_tokens(sid, extra)
            model.tokens[sid] += extra
        elif op < 0.56:  # write pending tokens of a few sequences in one step
            rows: list[tuple[int, int]] = []
            for sid in rng.sample(live, min(len(live), rng.randrange(1, 4))):
                pending = len(model.tokens[sid]) - model.stored[sid]
                if pending == 0:
                    continue
                n = rng.randrange(1, pending + 1)
                try:
                    pool.reserve(sid, n)
                except OutOfBlocks:
                    continue
                rows.append((sid, n))
            if rows:
                steps += 1
                got = _write_and_read(pool, rows)
                for sid, n in rows:
                    model.stored[sid] += n
                    assert got[sid] == [float(t) for t in model.tokens[sid][: model.stored[sid]]]
        elif op < 0.72:  # fork
            sid = rng.choice(live)
            pool.fork(sid, next_id)
            model.tokens[next_id] = list(model.tokens[sid])
            model.stored[next_id] = model.stored[sid]
            next_id += 1
        elif op < 0.97:  # free
            sid = rng.choice(live)
            pool.free(sid)
            del model.tokens[sid], model.stored[sid]
        else:  # drop the prefix cache
            pool.allocator.evict_all()
        if ops % 10 == 0:
            holders: dict[int, int] = {}
            for sid in model.tokens:
                assert pool.num_computed(sid) == model.stored[sid]
                for blk in pool.block_table(sid):
                    holders[blk] = holders.get(blk, 0) + 1
            for blk in range(pool.num_blocks):
                assert pool.allocator.refcount(blk) == holders.get(blk, 0)
            pool.allocator.check()
            assert pool.stored_slots() == _stored_slots(pool.manager)
    assert steps > 1000 and pool.allocator.hits > 1000 and pool.copies > 100
    for sid in list(model.tokens):
        pool.free(sid)
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == pool.num_blocks
    pool.allocator.check()


def test_the_kv_manager_and_the_allocator_are_torch_free() -> None:
    """The book-keeping of a paged cache imports no tensor library (it only names blocks)."""
    import ast
    import importlib

    for name in ("attnlab.cache.paged.manager", "attnlab.cache.paged.allocator"):
        path = importlib.import_module(name).__file__
        assert path is not None
        with open(path) as f:
            tree = ast.parse(f.read())
        imported = {
            n.module if isinstance(n, ast.ImportFrom) else a.name
            for n in ast.walk(tree)
            if isinstance(n, ast.Import | ast.ImportFrom)
            for a in (n.names if isinstance(n, ast.Import) else [n])  # type: ignore[attr-defined]
        }
        assert not any(
            m and (m == "torch" or m.startswith(("torch.", "attnlab.functional"))) for m in imported
        ), (name, imported)
