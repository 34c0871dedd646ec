"""The engine with a quantized paged pool: greedy tokens equal decoding alone through the
contiguous per-token-quantized cache; unsupported kv_dtypes are refused by name."""

from __future__ import annotations

import argparse
import random
from typing import Any

import pytest
import torch

from attnlab.cache.quantized import QuantizedKVCache
from attnlab.cli import serve
from attnlab.cli.main import main
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig
from attnlab.models.recurrent import MambaLM
from attnlab.models.recurrent_config import MambaConfig
from attnlab.serving import Engine, SamplingParams

V = 384


def _alone(model: DecoderLM, prompt: list[int], n: int, kv_dtype: str) -> list[int]:
    # keys per channel in the pool: the block (4 tokens here) is the group
    mode = "channel" if kv_dtype.endswith("-channel") else "token"
    bits = kv_dtype.removesuffix("-channel")
    cache = model.new_cache()
    cache.layers = [QuantizedKVCache(kv_dtype=bits, key_mode=mode, group=4, residual=0) for _ in cache.layers]  # fmt: skip
    out = model.generate(torch.tensor([prompt]), n, cache=cache)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "int4-channel"])
def test_engine_with_a_quantized_pool(kv_dtype: str, tokenizer: Any) -> None:
    torch.manual_seed(0)
    config = DecoderConfig.llama(
        vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
    )  # fmt: skip
    model = DecoderLM(config).eval()
    rng = random.Random(3)
    prompts = [[rng.randrange(V) for _ in range(rng.randrange(3, 20))] for _ in range(4)]
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True) for _ in prompts]
    engine = Engine(model, tokenizer, num_blocks=24, block_size=4, max_num_batched_tokens=16, kv_dtype=kv_dtype)  # fmt: skip
    float_engine = Engine(model, tokenizer, num_blocks=24, block_size=4)
    # per-channel keys pay a scale and minimum per channel per block: with blocks of 4
    # tokens that is as much as the int4 levels (KIVI's groups are 32 tokens)
    bound = 0.5 if kv_dtype.endswith("-channel") else 0.4
    assert engine.pool.bytes_per_block() < float_engine.pool.bytes_per_block() * bound
    for prompt, choices in zip(prompts, engine.generate(prompts, params)):
        assert choices[0].token_ids == _alone(model, prompt, 6, kv_dtype)
    assert engine.pool.num_used_blocks == 0


def test_refusals(tokenizer: Any, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    config = DecoderConfig.llama(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)  # fmt: skip
    model = DecoderLM(config).eval()
    with pytest.raises(
        ValueError, match=r"kv_dtype must be 'float' or one of \['int8', 'int4', 'int8-channel'"
    ):
        Engine(model, tokenizer, kv_dtype="int2")
    assert Engine(model, tokenizer, num_blocks=4, kv_dtype="float").pool.storage.kv_dtype is None
    with pytest.raises(ValueError, match="re-rounded when rejected drafts are rewritten"):
        Engine(model, tokenizer, num_blocks=4, kv_dtype="int4-channel", speculative="prompt_lookup")
    assert Engine(model, tokenizer, num_blocks=4, kv_dtype="int4", speculative="prompt_lookup")
    mamba = MambaLM(MambaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1)).eval()
    with pytest.raises(ValueError, match="no attention layers"):
        Engine(mamba, tokenizer, max_model_len=64, kv_dtype="int8")
    assert main(["serve", "--kv-dtype", "fp8"]) == 2
    assert "invalid choice: 'fp8'" in capsys.readouterr().err
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--kv-dtype", "int4-channel"])  # KIVI's keys, by name
    assert args.kv_dtype == "int4-channel"
