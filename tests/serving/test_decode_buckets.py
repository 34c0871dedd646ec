"""Compiled decode buckets and the runner's block-table rows: output equal to offline
``generate``, refusals with their reasons, rows equal to the manager's lists."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from attnlab.cache.paged.block_rows import BlockRows
from attnlab.cache.paged.manager import FREED, KVManager
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.recurrent import MambaLM
from attnlab.models.recurrent_config import MambaConfig
from attnlab.serving import Engine
from attnlab.serving.decode_buckets import (
    DecodeBuckets,
    bucket_refusal,
    enable_for_serving,
    parse_sizes,
)
from attnlab.serving.metrics import step_kinds_text

COMMON = dict(
    vocab_size=384,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    max_position_embeddings=128,
)


def _staggered(engine: Engine, prompts: list, params: list, every: int) -> dict:
    """Run the requests, request ``i`` added at step ``every * i`` (so that prompts meet
    decoding sequences in mixed steps); ``{(i, choice): token ids}``."""
    out: dict[tuple[int, int], list[int]] = {}
    step = 0
    while step // every < len(prompts) or engine.has_work():
        if step % every == 0 and step // every < len(prompts):
            i = step // every
            engine.add_request(f"r{i}", prompts[i], params[i])
        for o in engine.step():
            for d in o.outputs:
                out.setdefault((int(o.request_id[1:]), d.index), []).extend(d.token_ids)
        step += 1
    return out


def test_bucketed_greedy_equals_generate_with_forks_preemption_and_a_window(
    tokenizer: Any, prefix_prompts: Any, greedy_params: Any
) -> None:
    # the one compiled test (a decode bucket and the prompt graph, ~20-40 s of compiling):
    # Mistral's window frees blocks behind it, so the kernel's first live block comes from
    # the steps' metadata; staggered arrivals give prompts beside 0 to 8 decode rows (more
    # than the decode bucket), prefix hits and second chunks (continuing prompts: their
    # keys partly in the pool), forks and preemptions
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.mistral(sliding_window=16, **COMMON)).eval()
    rng = random.Random(1)
    prompts = prefix_prompts(rng, 384, shared=10, count=9, lengths=(1, 22))
    params = greedy_params(rng, len(prompts), max_tokens=(4, 12))
    engine = Engine(model, tokenizer, num_blocks=12, block_size=4, max_num_batched_tokens=16)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    buckets = engine.runner.compile_buckets((4,), max_model_len=64)
    prefill = engine.runner.compile_prefill(max_model_len=64)
    assert set(buckets.compile_seconds) == {4} and prefill.compile_seconds is not None
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs - before == 2  # one decode bucket, one prompt graph
    scratch = engine.pool.num_blocks  # the spare block past the manager's
    got = _staggered(engine, prompts, params, every=1)
    # the warm-up's graphs serve the engine's steps (same inference mode), and the prompt
    # graph every decode-row count and chunk length (both dynamic): no second compile
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        ref = model.generate(torch.tensor([prompt]), p.max_tokens)[0, len(prompt) :].tolist()
        assert [got[i, c] for c in range(p.n)] == [ref] * p.n, i
    kinds = engine.runner.step_kinds
    assert buckets.steps > 0  # some decode steps ran compiled (1-4 rows padded to 4)
    assert prefill.steps > 0  # (a 1-token prompt beside decode rows runs in a decode bucket)
    assert not [k for k in kinds if "prompts" in k and k.endswith("eager")], kinds
    ran = {k.rsplit(" beside", 1)[0] for k in kinds if "prompts" in k}
    assert ran == {"fresh prompts", "continuing prompts"}, kinds
    assert any("1-8" in k for k in kinds if "prompts" in k)  # beside more than 4
    text = step_kinds_text(dict(kinds))  # as /metrics shows them
    decode = (
        f'attnlab_steps_by_kind_total{{kind="decode",run="compiled"}} {kinds["decode, compiled"]}'
    )
    assert decode in text.splitlines()
    assert engine.scheduler.preemptions > 0
    assert engine.pool.num_used_blocks == 0 and engine.pool.storage.num_blocks == scratch + 1


def test_refused_with_the_reason() -> None:
    mamba = MambaLM(MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1)).eval()
    engine = Engine(mamba, None, num_blocks=16, block_size=4, max_model_len=32)
    assert "recurrent layers" in (bucket_refusal(engine.runner) or "")
    with pytest.raises(ValueError, match="compiled decode buckets refused: the model has rec"):
        DecodeBuckets(engine.runner, (1,), max_model_len=32)
    torch.manual_seed(0)
    bloom = DecoderLM(DecoderConfig.bloom(**COMMON)).eval()  # ALiBi: the kernel runs none
    engine = Engine(bloom, None, num_blocks=16, block_size=4)
    assert "score modifiers" in (bucket_refusal(engine.runner) or "")
    with pytest.raises(ValueError, match="positive ints"):
        parse_sizes("1,x")
    assert parse_sizes("8, 1,2") == (1, 2, 8)


def test_block_rows_equal_the_managers_lists_under_random_operations() -> None:
    rng = random.Random(0)
    m = KVManager(num_blocks=24, block_size=2, prefix_caching=True, sliding_window=5)
    rows = BlockRows(m, width=2, rows=2)  # both grow
    live: list[int] = []
    for i in range(3000):
        op = rng.random()
        if op < 0.1 and len(live) < 8:
            m.add_sequence(i, [rng.randrange(2) for _ in range(rng.randrange(1, 6))])
            live.append(i)
        elif op < 0.15 and live:
            sid = live.pop(rng.randrange(len(live)))
            m.free(sid)
            if rng.random() < 0.5:
                rows.release(sid)  # else a stale row, reclaimed when the rows run out
        elif op < 0.2 and live and len(live) < 8:
            m.fork(rng.choice(live), i)  # shares the blocks: copy-on-write follows
            live.append(i)
        elif live:
            sid = rng.choice(live)
            s, k = m._seq(sid), rng.randrange(1, 4)
            m.append_tokens(sid, [rng.randrange(2) for _ in range(k)])
            if m.blocks_needed(sid, k) > m.num_free_blocks:
                m.truncate(sid, max(s.computed, s.reserved))  # drafts rejected
                continue
            m.reserve(sid, k)
            if rng.random() < 0.2:  # a verify step keeps some of its drafts
                kept = rng.randrange(k + 1)
                m.truncate(sid, s.computed + kept)
                m.commit(sid, kept)
            else:
                m.commit(sid, k)
        if live and rng.random() < 0.5:
            some = rng.sample(live, rng.randrange(1, len(live) + 1))
            for r, sid in zip(rows.rows(some), some):
                blocks = m._seq(sid).blocks
                got = rows.table[r, : len(blocks)].tolist()
                assert [g for g, b in zip(got, blocks) if b != FREED] == [
                    b for b in blocks if b != FREED
                ]
    assert m.copies > 0  # copy-on-write replaced last blocks the rows had seen


def test_serve_flag_and_the_refusal_at_startup(capsys: pytest.CaptureFixture[str]) -> None:
    from attnlab.cli.main import main
    from attnlab.cli.serve import decode_buckets

    assert main(["serve", "--decode-buckets", "1,0"]) == 2
    assert "--decode-buckets" in capsys.readouterr().err
    assert decode_buckets("auto") == ((1, 2, 4, 8, 16, 32), False)
    assert decode_buckets("off") == (None, False)
    assert decode_buckets("4,1") == ((1, 4), True)
    mamba = MambaLM(MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1)).eval()
    engine = Engine(mamba, None, num_blocks=16, block_size=4, max_model_len=32)
    said = enable_for_serving(engine, (1, 2), required=False)  # auto: eager, with the reason
    assert said.startswith("eager decode steps (compiled buckets refused: the model has rec")
    assert engine.runner.buckets is None
    with pytest.raises(ValueError, match="--decode-buckets: compiled decode buckets refused"):
        enable_for_serving(engine, (1, 2), required=True)
    assert enable_for_serving(engine, None, required=True) == "eager decode steps"
