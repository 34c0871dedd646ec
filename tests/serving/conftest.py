"""A tiny model folder for the serving tests: a random Llama-style decoder and a byte-level
BPE tokenizer trained here on the standard library's source, saved as transformers does."""

from __future__ import annotations

import random
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_model_dir(folder: Path, *, family: str = "llama", vocab: int = 384) -> Path:
    """Train the tokenizer, build the model, save both into ``folder``."""
    import transformers
    from tokenizers import ByteLevelBPETokenizer

    import attnlab
    from attnlab.models.decoder import DecoderLM
    from attnlab.models.decoder_config import DecoderConfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text(encoding="utf-8") for name in ("textwrap.py", "string.py")]
    texts.append("héllo wörld ünïcödé ✓ 日本語 😀 " * 20)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        texts, vocab_size=vocab, min_frequency=2, special_tokens=["<|endoftext|>"]
    )
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    tok.chat_template = CHAT_TEMPLATE
    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=192,
        eos_token_id=tok.eos_token_id,
    )
    make = {
        "llama": DecoderConfig.llama,
        "gpt2": DecoderConfig.gpt2,
        "bloom": DecoderConfig.bloom,
        "mistral": lambda **kw: DecoderConfig.mistral(sliding_window=8, **kw),
    }[family]
    torch.manual_seed(0)
    model = DecoderLM(make(**common)).eval()
    folder.mkdir(parents=True, exist_ok=True)
    attnlab.to_hf(model).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Any:
    """The tiny folder's tokenizer, loaded once (the serving tests only read it)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


def _prefix_prompts(
    rng: random.Random, vocab: int, *, shared: int, count: int, lengths: tuple[int, int]
) -> list[list[int]]:
    """``count`` random prompts, about 60% of them behind one shared prefix of ``shared``
    tokens (prefix-cache hits), each with ``randrange(*lengths)`` tokens of its own."""
    head = [rng.randrange(vocab) for _ in range(shared)]
    return [
        (head if rng.random() < 0.6 else [])
        + [rng.randrange(vocab) for _ in range(rng.randrange(*lengths))]
        for _ in range(count)
    ]


@pytest.fixture(scope="session")
def prefix_prompts() -> Callable[..., list[list[int]]]:
    """The request mixes of the engine tests: ``prefix_prompts(rng, vocab, shared=,
    count=, lengths=)``."""
    return _prefix_prompts


def _greedy_params(rng: random.Random, count: int, max_tokens: tuple[int, int]) -> list[Any]:
    """Greedy ``SamplingParams`` (``ignore_eos``) with ``randrange(*max_tokens)`` tokens;
    every third request asks for ``n=2`` (a fork)."""
    from attnlab.serving import SamplingParams

    return [
        SamplingParams(
            max_tokens=rng.randrange(*max_tokens),
            temperature=0.0,
            ignore_eos=True,
            n=1 + (i % 3 == 0),
        )
        for i in range(count)
    ]


@pytest.fixture(scope="session")
def greedy_params() -> Callable[..., list[Any]]:
    """``greedy_params(rng, count, max_tokens=(lo, hi))``: see :func:`_greedy_params`."""
    return _greedy_params


def _small_engine(model: Any, tokenizer: Any, **kw: Any) -> Any:
    # 16 blocks of 4 tokens cannot hold every running sequence: preemption is forced;
    # 16 tokens a step chunk the prompts
    from attnlab.serving import Engine

    settings: dict[str, Any] = dict(
        num_blocks=16, block_size=4, max_num_batched_tokens=16, max_model_len=160
    )
    return Engine(model, tokenizer, **{**settings, **kw})


@pytest.fixture(scope="session")
def small_engine() -> Callable[..., Any]:
    """``small_engine(model, tokenizer, **overrides)``: an engine that preempts and chunks."""
    return _small_engine
