"""The trained model as a folder that ``attnlab generate`` and ``attnlab.from_hf`` load.

A model transformers has an equivalent for is saved as a transformers folder
(``config.json`` + ``model.safetensors``), with the run's tokenizer (``tokenizer.json``);
any other model is saved as ``model.safetensors`` + ``attnlab_config.json``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from torch import nn

from attnlab._files import atomic_folder

__all__ = ["export_model"]

log = logging.getLogger(__name__)


def export_model(model: nn.Module, folder: Path, *, tokenizer: Any = None) -> Path:
    """Write ``model`` (and ``tokenizer``, if any) to ``folder``; return the folder.

    The folder appears whole or not at all (built beside it, then renamed: see
    :func:`attnlab._files.atomic_folder`); an existing one is replaced.
    """
    folder = Path(folder)
    marked = any((folder / f).is_file() for f in ("config.json", "attnlab_config.json"))
    if folder.is_dir() and any(folder.iterdir()) and not marked:
        raise ValueError(
            f"{folder} holds other files and no model (no config.json); the model "
            "replaces the whole folder: give a new or empty one"
        )
    with atomic_folder(folder) as tmp:
        _write(model, tmp, tokenizer)
    return folder


def _write(model: nn.Module, folder: Path, tokenizer: Any) -> None:
    from attnlab.interop.hf import to_hf

    was_training = model.training
    try:
        hf = to_hf(model)
    except (ValueError, ImportError) as e:
        import safetensors.torch

        log.info("saving in attnlab's own format (%s)", e)
        safetensors.torch.save_model(model, str(folder / "model.safetensors"))
        config = getattr(model, "config", None)
        info = {
            "model_class": f"{type(model).__module__}:{type(model).__name__}",
            "config_class": f"{type(config).__module__}:{type(config).__name__}",
            "config": config.to_dict() if config is not None else {},
        }
        (folder / "attnlab_config.json").write_text(json.dumps(info, indent=2) + "\n")
    else:
        from transformers.utils import logging as hf_logging

        shown = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # no bar for one small file
        try:
            hf.save_pretrained(str(folder))  # type: ignore[operator]
        finally:
            if shown:
                hf_logging.enable_progress_bar()
    finally:
        model.train(was_training)
    if tokenizer is not None:
        tokenizer.save(folder)
