"""A tiny model folder for the serving tests: a random Llama-style decoder and a byte-level
BPE tokenizer trained here on the standard library's source, saved as transformers does."""

from __future__ import annotations

import sysconfig
from pathlib import Path

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
