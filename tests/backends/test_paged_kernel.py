"""The ``paged_kernel`` backend (a C++ kernel reading the pool in place) equals contiguous
attention, the ``paged`` block copy and the gather path; the engine's greedy output
through it equals offline ``generate``; ``auto`` ranks it and says why when it cannot run."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from attnlab import backends
from attnlab.backends import AttentionCall, choose_call, native
from attnlab.backends.paged import paged_attention
from attnlab.backends.paged_kernel import paged_kernel_attention, pattern_window
from attnlab.backends.plan import BlockTable
from attnlab.cache import PagedKVPool
from attnlab.functional.masks import causal, padding, sliding_window
from attnlab.functional.score_mods import alibi, softcap
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.serving import Engine, SamplingParams

BS = 4


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    reason = native.paged_status()  # builds it once per machine (cached), or says why not
    if reason is not None and "no C++ compiler" in reason:
        pytest.skip(reason)
    assert reason is None, reason


def _pools(lengths: list[int], heads_kv: int, e: int, seed: int = 0) -> tuple:
    """Pools of 64 blocks holding each row's keys in shuffled blocks; the rows' contiguous
    keys ``[H_kv, n, E]`` alongside."""
    g = torch.Generator().manual_seed(seed)
    kp = torch.randn(64 * BS, heads_kv, e, generator=g)
    vp = torch.randn(64 * BS, heads_kv, e + 2, generator=g)  # Ev != E
    perm = torch.randperm(64, generator=g).tolist()
    tables, used = [], 0
    for n in lengths:
        k = -(-n // BS)
        tables.append(perm[used : used + k])
        used += k
    nb = max(map(len, tables))
    table = torch.tensor([t + [0] * (nb - len(t)) for t in tables])
    bt = BlockTable(table, BS, tuple(lengths), (0,) * len(lengths), (0,) * len(lengths))
    rows = []
    for t, n in zip(tables, lengths):
        slots = torch.tensor([t[p // BS] * BS + p % BS for p in range(n)], dtype=torch.long)
        rows.append((kp[slots].transpose(0, 1), vp[slots].transpose(0, 1)))
    return kp, vp, bt, rows


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("width", [1, 5])  # a decode step, a prefill chunk
def test_paged_kernel_equals_contiguous_attention(
    heads: tuple[int, int], window: int | None, width: int
) -> None:
    h, h_kv = heads
    lengths = [9, 1, 14, 4, 5]  # partial last blocks, a whole one, length 1
    kp, vp, bt, rows = _pools(lengths, h_kv, 8)
    q = torch.randn(len(lengths), h, width, 8)
    # each row's newest ``width`` tokens (a row shorter than that repeats its first)
    q_pos = torch.tensor([[max(n - width + j, 0) for j in range(width)] for n in lengths])
    pattern = causal() if window is None else sliding_window(window)
    got, _ = paged_kernel_attention(q, kp, vp, pattern, block_table=bt, q_positions=q_pos)
    for b, (k, v) in enumerate(rows):
        n = lengths[b]
        kk, qq = torch.arange(n)[None], q_pos[b][:, None]
        allowed = kk <= qq
        if window is not None:
            allowed &= kk >= qq - window
        want = torch.nn.functional.scaled_dot_product_attention(
            q[b : b + 1], k[None], v[None], allowed, enable_gqa=True
        )[0]
        torch.testing.assert_close(got[b], want, atol=1e-5, rtol=1e-5)


def test_paged_kernel_equals_the_block_copy_on_a_left_padded_step(
    pool_with: Callable[..., tuple[PagedKVPool, BlockTable]],
) -> None:
    # the pool's own left-padded layout: slots offset per row, queries at the newest slot
    lengths = [9, 3, 14]
    pool, blocks = pool_with(lengths, BS, torch.float32)
    t = max(lengths)
    q = torch.randn(3, 4, 1, 8)
    mask = torch.tensor([[0] * (t - n) + [1] * n for n in lengths])
    q_pos = torch.tensor([[t - 1]])
    want, _ = paged_attention(
        q, pool.keys[0], pool.values[0], causal() & padding(mask), enable_gqa=True,
        q_positions=q_pos, block_table=blocks,
    )  # fmt: skip
    got, _ = paged_kernel_attention(
        q, pool.keys[0], pool.values[0], causal(), q_positions=q_pos, block_table=blocks
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # freed blocks (before first_block) are not read: NaN there changes nothing
    freed = BlockTable(blocks.table, BS, blocks.lengths, blocks.offsets, (1, 0, 1))
    window = sliding_window(4)  # the newest 5 keys: all in the blocks still held
    want, _ = paged_attention(
        q, pool.keys[0], pool.values[0], window & padding(mask), enable_gqa=True,
        q_positions=q_pos, block_table=freed,
    )  # fmt: skip
    for row in (0, 2):
        blk = int(blocks.table[row, 0])
        pool.keys[0][blk * BS : (blk + 1) * BS] = float("nan")
    got, _ = paged_kernel_attention(
        q, pool.keys[0], pool.values[0], window, q_positions=q_pos, block_table=freed
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_query_that_sees_no_key_gets_zeros() -> None:
    kp, vp, bt, _ = _pools([8], 2, 8)
    freed = BlockTable(bt.table, BS, bt.lengths, bt.offsets, (1,))  # keys 0..3 freed
    q = torch.randn(1, 2, 1, 8)
    got, _ = paged_kernel_attention(
        q, kp, vp, causal(), block_table=freed, q_positions=torch.tensor([[2]])
    )
    assert torch.equal(got, torch.zeros(1, 2, 1, 10))


def test_patterns_the_kernel_runs_and_refuses() -> None:
    assert pattern_window(causal(), False) == -1
    assert pattern_window(None, True) == -1
    assert pattern_window(sliding_window(7), False) == 7
    assert pattern_window(causal() & sliding_window(3), False) == 3
    assert "score modifiers" in str(pattern_window(causal().with_scores(softcap(30.0)), False))
    assert "causal" in str(pattern_window(None, False))
    assert "only causal" in str(pattern_window(padding(torch.ones(1, 4)), True))
    kp, vp, bt, _ = _pools([4], 2, 8)
    with pytest.raises(ValueError, match="paged_kernel backend runs no score modifiers"):
        paged_kernel_attention(
            torch.randn(1, 2, 1, 8), kp, vp, causal().with_scores(alibi(torch.ones(2))),
            block_table=bt,
        )  # fmt: skip


def test_bad_tables_and_dtypes_are_refused_by_name() -> None:
    kp, vp, bt, _ = _pools([6], 2, 8)
    q = torch.randn(1, 2, 1, 8)
    past = BlockTable(torch.tensor([[0, 64]]), BS, (6,), (0,), (0,))  # block 64 of 64
    with pytest.raises(ValueError, match="block ids up to 64; the pools hold 64 blocks"):
        paged_kernel_attention(q, kp, vp, causal(), block_table=past)
    short = BlockTable(torch.tensor([[0]]), BS, (6,), (0,), (0,))  # 6 tokens in 1 block
    with pytest.raises(ValueError, match="rows of up to 6 tokens in 1 blocks"):
        paged_kernel_attention(q, kp, vp, causal(), block_table=short)
    with pytest.raises(TypeError, match="runs float32"):
        paged_kernel_attention(q.double(), kp.double(), vp.double(), causal(), block_table=bt)


def _call(**kw: object) -> AttentionCall:
    base: dict = dict(
        query_shape=(32, 4, 1, 64),
        key_shape=(32, 4, 160, 64),
        value_shape=(32, 4, 160, 64),
        dtype=torch.float32,
        device=torch.device("cpu"),
        mask="pattern",
        pattern=causal(),
        is_causal=False,
        dropout_p=0.0,
        enable_gqa=False,
        needs_grad=False,
        return_weights=False,
        positions=True,
        block_size=16,
    )
    return AttentionCall(**(base | kw))


def test_auto_ranks_the_kernel_and_explains_its_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    decode = choose_call(_call())
    assert decode.chosen == "paged_kernel", decode.estimates  # a serving decode step
    assert {"paged", "sdpa", "paged_kernel"} <= set(decode.estimates)
    for kw, why in (
        ({"dtype": torch.float64}, "float32 only"),
        ({"needs_grad": True}, "no gradients"),
        ({"pattern": causal().with_scores(softcap(30.0))}, "score modifiers"),
        ({"block_size": 0}, "block table"),
    ):
        assert why in choose_call(_call(**kw)).reasons["paged_kernel"]
    # a machine where the kernel cannot be built: refused with the reason, others ranked
    monkeypatch.setitem(native._state, "paged", "no C++ compiler found to build the kernel")
    backends.forget_choices()
    try:
        other = choose_call(_call())
        assert other.chosen != "paged_kernel"
        assert "no C++ compiler" in other.reasons["paged_kernel"]
    finally:
        backends.forget_choices()


@pytest.mark.parametrize("window", [None, 6])
def test_engine_greedy_through_the_kernel_equals_offline_generate(window: int | None) -> None:
    torch.manual_seed(0)
    config = DecoderConfig.llama(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
        sliding_window=window,
    )  # fmt: skip
    model = DecoderLM(config).eval()
    rng = random.Random(1)
    shared = [rng.randrange(97) for _ in range(9)]
    prompts = [shared + [rng.randrange(97) for _ in range(rng.randrange(1, 12))] for _ in range(5)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    class Ids:
        eos_token_id = None

        def encode(self, text: str, **_: object) -> list[int]:
            return [int(t) for t in text.split()]

        def decode(self, ids: list[int], **_: object) -> str:
            return "".join(f" {i}" for i in ids)

    engine = Engine(model, Ids(), num_blocks=40, block_size=4, max_num_batched_tokens=24)
    with backends.use("paged_kernel"):
        results = engine.generate(prompts, [params] * len(prompts))
    for prompt, choices in zip(prompts, results):
        ids = torch.tensor([prompt])
        want = model.generate(ids, 8)[0, len(prompt) :].tolist()
        assert choices[0].token_ids == want


def test_a_mixed_flat_step_ranks_each_group_on_its_own_call() -> None:
    # decode tokens and prefill chunks both read the pool in place: the kernel's GEMM
    # tiles beat the block copy + torch's flash kernel for chunks too (benchmarks/
    # paged_kernel.py), and ``auto`` says so group by group
    from attnlab.backends.plan import SequenceLayout, make_plan

    lengths = [1] * 8 + [64, 64]  # new tokens per sequence
    totals = (100,) * 8 + (64, 64)
    table = BlockTable(torch.zeros(10, 8, dtype=torch.long), 16, totals, (0,) * 10, (0,) * 10)
    layout = SequenceLayout.from_lengths(lengths, blocks=table)
    shape = {"query_shape": (10, 4, 64, 64), "key_shape": (10, 4, 100, 64)}
    call = _call(**shape, value_shape=(10, 4, 100, 64))
    plan = make_plan(call, pattern=causal(), layout=layout, blocks=table)
    names = [plan.group_backend(i).name for i in range(len(layout.groups))]
    assert layout.groups[0].width == 1 and len(names) > 1, names
    assert set(names) == {"paged_kernel"}, names
    assert plan.reads_blocks  # the cache hands over the pools
    for kw, why in (({"needs_grad": True}, "no gradients"), ({"dtype": torch.float64}, "float32")):
        other = make_plan(_call(**shape, value_shape=(10, 4, 100, 64), **kw), pattern=causal(),
                          layout=layout, blocks=table)  # fmt: skip
        assert "paged_kernel" not in [other.group_backend(i).name for i in range(len(names))], why
    with backends.use("sdpa"):  # a name (or use()) runs every group
        assert make_plan(call, pattern=causal(), layout=layout, blocks=table).group_backends == ()
