"""Reading weights and configs from a local model folder: safetensors only, nothing unpickled.

Every fault in a folder's files is a :class:`~attnlab.errors.ModelFileError` (a
``ValueError``) whose message names the file and what is wrong with it: a missing,
empty, truncated or corrupt ``model.safetensors``, a ``config.json`` that is not a
JSON object, a shard index without ``weight_map``, a shard that is missing or whose
path leaves the folder.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from torch import Tensor

from attnlab.errors import ModelFileError

__all__ = ["check_model_folder", "load_safetensors_dir", "read_config", "read_json_object"]


def check_model_folder(folder: str | Path) -> Path:
    """``folder`` as a Path if it is an existing folder, else raise naming it.

    The one check of a model folder's existence, for every entry that takes one
    (``from_hf``, ``load_embedding_model``, the serving engine, every command's
    ``--model``), so a missing folder is the same error, and the same exit status (1),
    everywhere.

    Raises:
        ModelFileError: ``folder`` does not exist or is not a folder.
    """
    path = Path(folder)
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a folder"
        raise ModelFileError(
            f"{path} {what}; pass a local model folder (config.json + safetensors)"
        )
    return path


# A safetensors header larger than this is not one attnlab wrote or can trust.
_MAX_HEADER_BYTES = 100 * 1024 * 1024


_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def _special_float(obj: dict[str, Any]) -> Any:
    """transformers 5 writes a non-finite float as ``{"__float__": "Infinity"}`` (strict
    JSON has none): read it back as the float (Mamba-2's ``time_step_limit``)."""
    if len(obj) == 1 and "__float__" in obj:
        value = obj["__float__"]
        if value in _FLOATS:
            return _FLOATS[value]
        try:
            return float(value)
        except (TypeError, ValueError):
            return obj
    return obj


def read_json_object(path: Path) -> dict[str, Any]:
    """Parse ``path`` as a JSON object (``{"__float__": "Infinity"}`` read as a float).

    Raises:
        ModelFileError: unreadable, malformed JSON (with line and column), or JSON that
            is not an object (a list, a string, ...).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path}: cannot be read: {e}") from None
    try:
        data = json.loads(text, object_hook=_special_float)
    except json.JSONDecodeError as e:
        raise ModelFileError(
            f"{path}: malformed JSON at line {e.lineno}, column {e.colno}: {e.msg}"
        ) from None
    if not isinstance(data, dict):
        raise ModelFileError(f"{path}: holds a JSON {type(data).__name__}, expected an object")
    return data


def read_config(folder: Path) -> dict[str, Any]:
    """Read ``config.json`` from ``folder``.

    Raises:
        ModelFileError: no ``config.json``, or one that is not a JSON object with a
            ``model_type``.
    """
    path = folder / "config.json"
    if not path.is_file():
        raise ModelFileError(f"{folder} has no config.json; expected a transformers model folder")
    data = read_json_object(path)
    if not isinstance(data.get("model_type"), str):
        raise ModelFileError(
            f"{path}: 'model_type' must name the architecture (a string such as 'llama'), got "
            f"{data.get('model_type')!r}"
        )
    return data


def _check_safetensors(path: Path) -> None:
    """Check a safetensors file's framing before loading it: header length, header JSON,
    and that every tensor's byte range lies inside the file.

    Raises:
        ModelFileError: empty, truncated or corrupt, with what was found.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if size < 8:
                raise ModelFileError(
                    f"{path}: {'empty' if size == 0 else 'truncated'} ({size} bytes); a "
                    "safetensors file starts with an 8-byte header length"
                )
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, _MAX_HEADER_BYTES):
                raise ModelFileError(
                    f"{path}: corrupt or truncated: the header claims {n} bytes, the file has "
                    f"{size - 8} after the length"
                )
            raw = f.read(n)
    except OSError as e:
        raise ModelFileError(f"{path}: cannot be read: {e}") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ModelFileError(f"{path}: corrupt: the header is not valid JSON") from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{path}: corrupt: the header is not a JSON object")
    data_bytes = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise ModelFileError(f"{path}: corrupt: tensor {name!r} has no valid data_offsets")
        if not 0 <= offsets[0] <= offsets[1] <= data_bytes:
            raise ModelFileError(
                f"{path}: truncated or corrupt: tensor {name!r} needs bytes {offsets[0]}..."
                f"{offsets[1]} of the data, the file holds {data_bytes}"
            )


def _load_file(path: Path) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    _check_safetensors(path)
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise ModelFileError(f"{path}: cannot be loaded as safetensors: {e}") from None


def _shards(folder: Path, index: Path) -> list[Path]:
    """The shard files a ``model.safetensors.index.json`` names, each checked to exist inside
    ``folder``."""
    data = read_json_object(index)
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelFileError(
            f"{index}: needs a non-empty 'weight_map' object (tensor name -> shard file), got "
            f"{weight_map!r:.80}"
        )
    root = folder.resolve()
    shards = []
    for name in sorted(set(weight_map.values()), key=str):
        if not isinstance(name, str) or not name:
            raise ModelFileError(f"{index}: a shard name must be a file name, got {name!r}")
        path = (folder / name).resolve()
        if not path.is_relative_to(root):
            raise ModelFileError(
                f"{index}: shard {name!r} lies outside the model folder {folder}; shards must "
                "be files inside it"
            )
        if not path.is_file():
            raise ModelFileError(f"{index}: names shard {name!r}, which {folder} does not hold")
        shards.append(path)
    return shards


def load_safetensors_dir(folder: Path) -> dict[str, Tensor]:
    """Load every tensor of ``model.safetensors`` (or its sharded index) in ``folder``.

    Raises:
        ImportError: ``safetensors`` is not installed (the ``hf`` extra).
        ModelFileError: no safetensors weights in the folder (pickled ``.bin`` files are
            never loaded: they can run code), or a damaged file (named, with the fault).
    """
    try:
        import safetensors.torch  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("reading weights needs safetensors: pip install 'attnlab[hf]'") from e
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if single.is_file():
        return _load_file(single)
    if index.is_file():
        out: dict[str, Tensor] = {}
        for shard in _shards(folder, index):
            out |= _load_file(shard)
        return out
    found = sorted(p.name for p in folder.iterdir())
    raise ModelFileError(
        f"{folder} has no model.safetensors (found {found}); attnlab reads safetensors only "
        "and never unpickles .bin files"
    )
