"""Reading weights and configs from a local model folder: safetensors only, nothing unpickled."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import Tensor

__all__ = ["load_safetensors_dir", "read_config"]


def read_config(folder: Path) -> dict[str, Any]:
    """Read ``config.json`` from ``folder``; raise ``ValueError`` if it is missing."""
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no config.json; expected a transformers model folder")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def load_safetensors_dir(folder: Path) -> dict[str, Tensor]:
    """Load every tensor of ``model.safetensors`` (or its sharded index) in ``folder``.

    Raises:
        ImportError: ``safetensors`` is not installed (the ``hf`` extra).
        ValueError: no safetensors weights in the folder (pickled ``.bin`` files are
            never loaded: they can run code).
    """
    try:
        from safetensors.torch import load_file
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("reading weights needs safetensors: pip install 'attnlab[hf]'") from e
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if single.is_file():
        return load_file(str(single))
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        out: dict[str, Tensor] = {}
        for shard in shards:
            out |= load_file(str(folder / shard))
        return out
    found = sorted(p.name for p in folder.iterdir())
    raise ValueError(
        f"{folder} has no model.safetensors (found {found}); attnlab reads safetensors only "
        "and never unpickles .bin files"
    )
