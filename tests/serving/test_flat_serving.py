"""Flat token batches: one ``[1, N]`` row per step, for attention, recurrent and hybrid
models alike, equal to the uncached forward, token for token.

The reference of every model is its own uncached forward, greedy, one token at a time
(no cache, no serving code): a random request mix (shared prefixes, ``n = 2`` forks,
a pool too small for all of them so sequences are preempted and recomputed, a token
budget that chunks the prompts) must produce exactly its tokens.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch import nn

from attnlab.backends import use
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.layout import LayerSpec, MambaLayerConfig
from attnlab.models.linear_layout import LinearLayerConfig
from attnlab.models.recurrent import RWKVLM, MambaLM, RetNetLM
from attnlab.models.recurrent_config import MambaConfig, RetNetConfig, RWKVConfig
from attnlab.serving import Engine
from attnlab.serving.runner import ModelRunner, layer_specs, pool_for

V = 384
SMALL = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2)
ATTN = dict(
    SMALL,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
MAMBA = LayerSpec(mixer="mamba", mamba=MambaLayerConfig(state_size=4, chunk_size=4))
GLA = LayerSpec(mixer="gla", linear=LinearLayerConfig(num_heads=2, chunk_size=4))


def _hybrid(*layers: LayerSpec) -> DecoderConfig:
    return DecoderConfig(
        vocab_size=V,
        hidden_size=32,
        num_hidden_layers=len(layers),
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        max_position_embeddings=128,
        layers=layers,
    )


BUILD: dict[str, Any] = {
    "llama": lambda: DecoderLM(DecoderConfig.llama(**ATTN)),
    "gpt2": lambda: DecoderLM(DecoderConfig.gpt2(**ATTN)),
    "mistral": lambda: DecoderLM(DecoderConfig.mistral(sliding_window=6, **ATTN)),
    "bloom": lambda: DecoderLM(DecoderConfig.bloom(**ATTN)),
    "jamba-like": lambda: DecoderLM(_hybrid(MAMBA, LayerSpec(), MAMBA)),
    "gla-hybrid": lambda: DecoderLM(_hybrid(GLA, LayerSpec())),
    "mamba": lambda: MambaLM(MambaConfig(**SMALL, chunk_size=4)),
    "mamba2": lambda: MambaLM(
        MambaConfig(**SMALL, version=2, head_dim=8, state_size=8, n_groups=2, chunk_size=4)
    ),
    "rwkv": lambda: RWKVLM(RWKVConfig(**SMALL, intermediate_size=48, chunk_size=4)),
    "retnet": lambda: RetNetLM(RetNetConfig(**SMALL, num_heads=2, chunk_size=4)),
}
STATEFUL = {"jamba-like", "gla-hybrid", "mamba", "mamba2", "rwkv", "retnet"}


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return BUILD[name]().eval()


@torch.no_grad()
def _greedy(model: nn.Module, prompt: list[int], n: int) -> list[int]:
    """The reference: the uncached forward, argmax, one token at a time."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("name", list(BUILD))
def test_flat_serving_equals_the_uncached_forward(
    name: str, tokenizer: Any, prefix_prompts: Any, greedy_params: Any
) -> None:
    model = _model(name)
    rng = random.Random(sum(map(ord, name)))
    prompts = prefix_prompts(rng, V, shared=9, count=6, lengths=(1, 12))
    params = greedy_params(rng, len(prompts), max_tokens=(4, 11))
    # 8 blocks of 4 tokens cannot hold every running sequence: preemption is forced
    engine = Engine(
        model, tokenizer, num_blocks=8, block_size=4, max_num_batched_tokens=16, max_model_len=128
    )
    results = engine.generate(prompts, params)
    for prompt, p, choices in zip(prompts, params, results):
        ref = _greedy(model, prompt, p.max_tokens)
        assert [c.token_ids for c in choices] == [ref] * p.n
    if name in STATEFUL:  # a state cannot resume from a cached prefix: refused, with why
        assert engine.prefix_caching_refused and engine.pool.allocator.hits == 0
    else:
        assert engine.prefix_caching_refused is None
        # (Mistral's sequences return the blocks behind their window of 6: its mix needs
        # fewer blocks and, with this draw, neither hits nor preempts)
        assert engine.pool.allocator.hits > 0 or name == "mistral"
    assert engine.metrics.preemptions > 0 or name == "mistral"
    assert engine.pool.num_used_blocks == 0 and not engine.requests
    assert not engine.runner.slots.slots  # every state slot went back


@pytest.mark.parametrize("backend", ["reference", "paged", "auto"])
@pytest.mark.parametrize("name", ["llama", "bloom", "jamba-like"])
def test_one_flat_row_of_chunks_and_decodes_equals_each_sequence_alone(
    name: str, backend: str
) -> None:
    model = _model(name)
    pool = pool_for(model, layer_specs(model), num_blocks=32, block_size=4, prefix_caching=False)
    runner = ModelRunner(model, pool, max_num_seqs=8)
    rng = random.Random(3)
    seqs = [[rng.randrange(V) for _ in range(n)] for n in (7, 3, 6, 1, 9)]
    # first step: chunks of every prompt but the last token; second: one token each
    for i, s in enumerate(seqs):
        pool.add_sequence(i, s)
    steps = [
        [(i, max(len(s) - 1, 1)) for i, s in enumerate(seqs) if len(s) > 1],
        [(i, 1) for i, s in enumerate(seqs) if len(s) > 1],
    ]
    steps[1].append((3, 1))
    with use(backend), torch.no_grad():
        for rows in steps:
            for sid, n in rows:
                pool.reserve(sid, n)
            logits = runner.run(rows)
            for sid, n in rows:
                pool.manager.commit(sid, n)
    with torch.no_grad():
        for r, (sid, _) in enumerate(steps[1]):
            ref = model(torch.tensor([seqs[sid]])).logits[0, -1]
            torch.testing.assert_close(logits[r], ref, atol=1e-4, rtol=1e-4)
