"""The ``paged`` backend: attention through block tables equals the gather path."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from attnlab import backends
from attnlab import scaled_dot_product_attention as sdpa
from attnlab.backends import AttentionCall, choose_call
from attnlab.backends.paged import BlockTable, paged_attention
from attnlab.cache import PagedKVPool
from attnlab.functional.masks import causal, padding, sliding_window
from attnlab.functional.score_mods import alibi

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cache"))
from test_paged_cache import FAMILIES, _model, _run_mix


@pytest.mark.parametrize("scored", [False, True])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_equals_the_reference_on_gathered_keys(
    window: int | None, scored: bool, pool_with: Callable[..., tuple[PagedKVPool, BlockTable]]
) -> None:
    torch.manual_seed(0)
    lengths = [9, 3, 14]
    pool, table = pool_with(lengths)
    t = max(lengths)
    q = torch.randn(3, 4, 1, 8, dtype=torch.float64)
    mask = torch.tensor([[0] * (t - n) + [1] * n for n in lengths])
    pattern = causal() if window is None else sliding_window(window - 1)
    pattern = pattern & padding(mask)
    if scored:
        pattern = pattern.with_scores(alibi(torch.tensor([0.5, 0.25, 0.125, 0.0625])))
    q_pos = torch.tensor([[t - 1]])
    k_pos = torch.arange(t)[None]
    step = pool.step
    assert step is not None
    k = pool.keys[0].index_select(0, step.gather).view(3, t, 2, 8).transpose(1, 2)
    v = pool.values[0].index_select(0, step.gather).view(3, t, 2, 8).transpose(1, 2)
    want = sdpa(
        q, k, v, pattern, enable_gqa=True, backend="reference", q_positions=q_pos, k_positions=k_pos
    )
    got, _ = paged_attention(
        q,
        pool.keys[0],
        pool.values[0],
        pattern,
        enable_gqa=True,
        q_positions=q_pos,
        block_table=table,
    )
    torch.testing.assert_close(got, want)


def test_paged_attention_skips_freed_blocks(
    pool_with: Callable[..., tuple[PagedKVPool, BlockTable]],
) -> None:
    # blocks before first_block are not read: garbage there must not change the output
    torch.manual_seed(1)
    pool, table = pool_with([13, 13])
    q = torch.randn(2, 4, 1, 8, dtype=torch.float64)
    pattern = sliding_window(4)  # keys at slots 8..12 for the query at 12
    q_pos = torch.tensor([[12]])
    args = dict(enable_gqa=True, q_positions=q_pos)
    want, _ = paged_attention(q, pool.keys[0], pool.values[0], pattern, **args, block_table=table)
    freed = BlockTable(table.table, table.block_size, table.lengths, table.offsets, (2, 2))
    for blk in table.table[:, :2].flatten().tolist():
        pool.keys[0][blk * 4 : (blk + 1) * 4] = float("nan")
    got, _ = paged_attention(q, pool.keys[0], pool.values[0], pattern, **args, block_table=freed)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_through_the_paged_backend_equal_contiguous(family: str) -> None:
    model = _model(family)
    ids = torch.randint(0, 97, (3, 7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    ref = model.generate(ids, 9, attention_mask=mask)
    pool = PagedKVPool.for_model(model, num_blocks=32, block_size=4)
    with backends.use("paged"):
        got = model.generate(ids, 9, attention_mask=mask, cache=pool.model_cache())
    assert torch.equal(got, ref)
    # the engine's steps: chunked prefill, prefix hits, forks, preemption
    pool = PagedKVPool.for_model(model, num_blocks=9, block_size=4)
    with backends.use("paged"):
        out, prompts = _run_mix(model, pool, seed=random.Random(family).randrange(100))
    for sid, toks in out.items():
        prompt = torch.tensor([prompts[sid]])
        assert model.generate(prompt, len(toks))[0, prompt.shape[1] :].tolist() == toks


def _call(block_size: int, b: int = 8, s: int = 2048) -> AttentionCall:
    return AttentionCall(
        query_shape=(b, 8, 1, 64),
        key_shape=(b, 2, s, 64),
        value_shape=(b, 2, s, 64),
        dtype=torch.float32,
        device=torch.device("cpu"),
        mask="pattern",
        pattern=causal(),
        is_causal=False,
        dropout_p=0.0,
        enable_gqa=True,
        needs_grad=False,
        return_weights=False,
        positions=True,
        block_size=block_size,
    )


def test_explain_says_which_path_a_paged_call_takes() -> None:
    contiguous = choose_call(_call(0))
    assert "block table" in contiguous.reasons["paged"]
    paged = choose_call(_call(16))
    assert paged.chosen in backends.available()
    assert set(paged.estimates) >= {"paged", "sdpa"}
    if paged.chosen not in ("paged", "paged_kernel"):  # the gather path pays for its copy
        assert "gathering the paged keys" in paged.reasons[paged.chosen]
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="'paged'.*cannot run this call.*block table"):
        sdpa(q, q, q, backend="paged")
