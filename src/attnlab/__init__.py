"""attnlab: Transformer self-attention and its variants, checked against the references."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "from_hf", "to_hf"]


def from_hf(model_or_local_dir: Any) -> Any:
    """Convert a ``transformers`` model, or a local folder (config.json + safetensors), to attnlab.

    See :func:`attnlab.interop.hf.from_hf`.
    """
    from attnlab.interop.hf import from_hf as _from_hf

    return _from_hf(model_or_local_dir)


def to_hf(model: Any) -> Any:
    """Convert an attnlab model to the ``transformers`` model with the same weights.

    See :func:`attnlab.interop.hf.to_hf`.
    """
    from attnlab.interop.hf import to_hf as _to_hf

    return _to_hf(model)
