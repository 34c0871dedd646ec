"""Paged decoding equals contiguous decoding (greedy tokens) for every decoder family."""

from __future__ import annotations

import random

import pytest
import torch

from attnlab import backends
from attnlab.cache import OutOfBlocks, PagedKVPool
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig

COMMON = dict(
    vocab_size=97,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    max_position_embeddings=128,
)
FAMILIES = {
    "gpt2": lambda: DecoderConfig.gpt2(**COMMON),
    "llama": lambda: DecoderConfig.llama(**COMMON),
    "mistral": lambda: DecoderConfig.mistral(sliding_window=6, **COMMON),
    "bloom": lambda: DecoderConfig.bloom(**COMMON),
}


def _model(family: str) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(FAMILIES[family]()).eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_with_a_paged_cache_equals_contiguous(family: str) -> None:
    model = _model(family)
    ids = torch.randint(0, 97, (3, 7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded row
    ref = model.generate(ids, 9, attention_mask=mask)
    pool = PagedKVPool.for_model(model, num_blocks=32, block_size=4)
    cache = pool.model_cache()
    assert torch.equal(model.generate(ids, 9, attention_mask=mask, cache=cache), ref)
    # 16 slots per row in blocks of 4; Mistral's window (6) freed all but the last 2
    held = 3 * (2 if family == "mistral" else 4)
    assert pool.num_used_blocks == held
    assert cache.layers[0].nbytes() == held * 4 * 2 * (2 * 8) * 4
    cache.reset()
    assert pool.num_used_blocks == 0


def _run_mix(
    model: DecoderLM, pool: PagedKVPool, seed: int
) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Greedy-decode a random mix of requests step by step with chunked prefill, shared
    prefixes, forks, and preemption (free, recompute later) when the pool is full."""
    rng = random.Random(seed)
    shared = [rng.randrange(97) for _ in range(9)]
    prompts = {
        i: (shared if rng.random() < 0.5 else [])
        + [rng.randrange(97) for _ in range(rng.randrange(1, 12))]
        for i in range(6)
    }
    want = {i: rng.randrange(3, 9) for i in prompts}
    out: dict[int, list[int]] = {i: [] for i in prompts}
    waiting = list(prompts)
    running: list[int] = []
    forked: set[int] = set()
    while waiting or running:
        while waiting and len(running) < 4:  # admit in arrival order
            sid = waiting.pop(0)
            pool.add_sequence(sid, prompts[sid] + out[sid])
            running.append(sid)
        rows: list[tuple[int, int]] = []
        for sid in list(running):
            if sid not in running:
                continue  # preempted by an earlier row of this step
            pending = pool.num_tokens(sid) - pool.num_computed(sid)
            n = min(pending, rng.randrange(1, 6))  # a chunk of the prefill, or one token
            while True:
                try:
                    pool.reserve(sid, n)
                    rows.append((sid, n))
                    break
                except OutOfBlocks:
                    victim = running[-1]  # the latest arrival is preempted
                    running.remove(victim)
                    rows = [r for r in rows if r[0] != victim]
                    pool.free(victim)
                    waiting.insert(0, victim)
                    if victim == sid:
                        break
        if not rows:
            continue
        step = pool.begin_step(rows)
        logits = model(
            step.input_ids,
            attention_mask=step.attention_mask,
            past_key_values=pool.model_cache(),
            logits_to_keep=1,
        ).logits[:, -1]
        pool.end_step()
        for r, (sid, _n) in enumerate(rows):
            if pool.num_computed(sid) < pool.num_tokens(sid):
                continue  # prefill not done
            tok = int(logits[r].argmax())
            out[sid].append(tok)
            if len(out[sid]) == want[sid]:
                running.remove(sid)
                pool.free(sid)
                continue
            pool.append_tokens(sid, [tok])
            if sid < 3 and sid not in forked and len(out[sid]) == 2:
                # a fork continues identically under greedy decoding; it must not disturb
                # its parent through the blocks they share
                child = 100 + sid
                forked.add(sid)
                pool.fork(sid, child)
                prompts[child], out[child], want[child] = prompts[sid], list(out[sid]), want[sid]
                running.append(child)
    assert pool.num_used_blocks == 0
    return out, prompts


@pytest.mark.parametrize("family", list(FAMILIES))
def test_paged_steps_equal_contiguous_over_a_random_mix(family: str) -> None:
    model = _model(family)
    hits = copies = 0
    for seed, num_blocks in ((0, 64), (1, 9)):  # 9 blocks of 4: preemption is forced
        pool = PagedKVPool.for_model(model, num_blocks=num_blocks, block_size=4)
        out, prompts = _run_mix(model, pool, seed)
        for sid, toks in out.items():
            prompt = torch.tensor([prompts[sid]])
            ref = model.generate(prompt, len(toks))[0, prompt.shape[1] :].tolist()
            assert toks == ref, (family, seed, sid)
        hits += pool.allocator.hits
        copies += pool.copies
    assert hits > 0 and copies > 0  # prefix hits and copy-on-write happened


@pytest.mark.parametrize("backend", ["auto", "paged"])
def test_mistral_frees_blocks_behind_its_window(backend: str) -> None:
    # a long generation holds at most ceil(W / bs) + 1 blocks per sequence, and still
    # equals contiguous (rolling window) decoding
    model = _model("mistral")  # sliding_window=6
    window, bs = 6, 4
    ids = torch.randint(0, 97, (2, 9))
    ref = model.generate(ids, 40)
    pool = PagedKVPool.for_model(model, num_blocks=16, block_size=bs)
    assert pool.sliding_window == window
    bound = 2 * (-(-window // bs) + 1)
    tokens = []
    with backends.use(backend):
        for tok in model.stream(ids, 40, cache=pool.model_cache()):
            assert pool.num_used_blocks <= bound
            tokens.append(tok)
    assert torch.equal(torch.cat([ids, torch.stack(tokens, 1)], 1), ref)
    # 49 tokens per row would need 13 blocks each without freeing: the pool has 16
    assert max(s.first_live for s in pool.seqs.values()) >= 10
    pool.reset()
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == 16


def test_windowed_pool_keeps_forks_and_prefix_hits_exact() -> None:
    model = _model("mistral")
    for seed, num_blocks in ((2, 64), (3, 9)):
        pool = PagedKVPool.for_model(model, num_blocks=num_blocks, block_size=2)
        out, prompts = _run_mix(model, pool, seed)
        for sid, toks in out.items():
            prompt = torch.tensor([prompts[sid]])
            assert model.generate(prompt, len(toks))[0, prompt.shape[1] :].tolist() == toks
