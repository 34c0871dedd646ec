"""Shared set-up of the paged-attention backend tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from attnlab.backends.paged import BlockTable
from attnlab.cache import PagedKVPool

PoolFactory = Callable[..., tuple[PagedKVPool, BlockTable]]


def _pool_with(
    lengths: list[int], bs: int = 4, dtype: torch.dtype = torch.float64
) -> tuple[PagedKVPool, BlockTable]:
    """A one-layer pool holding rows of ``lengths`` random tokens in interleaved blocks
    (written one token at a time across rows), and the block table of a decode step that
    queries each row's newest token (the pool's left-padded layout)."""
    pool = PagedKVPool(
        num_layers=1, num_kv_heads=2, head_dim=8, num_blocks=64, block_size=bs, dtype=dtype
    )
    pool.keys[0].normal_()
    pool.values[0].normal_()
    for r, n in enumerate(lengths):
        pool.add_sequence(r, [0] * n)
    for _ in range(max(lengths)):
        for r, n in enumerate(lengths):
            if pool.seqs[r].reserved < n:
                pool.reserve(r, 1)
    for r, n in enumerate(lengths):
        pool.seqs[r].computed = n - 1
    step = pool.begin_step([(r, 1) for r in range(len(lengths))])
    assert step.blocks is not None
    return pool, step.blocks


@pytest.fixture
def pool_with() -> PoolFactory:
    """``pool_with(lengths, bs=4, dtype=float64) -> (pool, block table)``."""
    return _pool_with
