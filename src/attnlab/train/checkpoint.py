"""Training checkpoints: weights, optimizer, scheduler, RNG and data position.

One process writes a plain folder::

    model.safetensors    the weights (safetensors; tied matrices stored once)
    optimizer.pt         AdamW's state (tensors and numbers only, read with weights_only)
    rng.safetensors      the RNG states (CPU, and CUDA when present)
    trainer.json         step, samples seen, the scheduler's state, the run's config

Several processes write the weights and optimizer state with
:mod:`torch.distributed.checkpoint` instead (``dcp/``: each rank saves its shards; a
later run with any number of processes, one included, loads and reshards them), next to
the same ``rng.safetensors`` and ``trainer.json``.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnlab._files import fsync_tree, replace_folder
from attnlab.errors import ModelFileError
from attnlab.train.distributed import DistContext

__all__ = [
    "check_same_model",
    "latest_checkpoint",
    "load_checkpoint",
    "read_trainer_state",
    "save_checkpoint",
]

log = logging.getLogger(__name__)


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("checkpoints need safetensors: pip install 'attnlab[hf]'") from e
    return safetensors.torch


def _rng_state() -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def save_checkpoint(
    folder: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    ctx: DistContext,
) -> None:
    """Write a checkpoint atomically (every process calls this when distributed).

    The files are written into a temporary folder beside ``folder`` (``.step-N.tmp-ckpt``),
    synced to disk, and the folder is renamed to ``folder`` last: a process killed while
    saving leaves the previous checkpoints whole and no ``step-N`` that looks complete.

    Args:
        folder: the checkpoint's folder (created, or replaced whole).
        model: the unwrapped model (FSDP2-sharded in place, or plain).
        optimizer: its optimizer.
        state: JSON-able trainer state (step, samples, scheduler, config).
        ctx: the process group context.
    """
    st = _safetensors()
    tmp = folder.with_name(f".{folder.name}.tmp-ckpt")  # one name that every rank agrees on
    if ctx.is_main:
        folder.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # the leftover of a killed save
            shutil.rmtree(tmp)
        tmp.mkdir()
    ctx.barrier()
    try:
        if ctx.enabled:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            msd, osd = get_state_dict(model, optimizer)
            dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp / "dcp"))
        else:
            st.save_model(model, str(tmp / "model.safetensors"))
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        if ctx.is_main:
            st.save_file(_rng_state(), str(tmp / "rng.safetensors"))
            # trainer.json last: inside the folder too, it marks the checkpoint complete
            (tmp / "trainer.json").write_text(json.dumps(state, indent=2) + "\n")
        ctx.barrier()
        if ctx.is_main:
            fsync_tree(tmp)
            replace_folder(tmp, folder)
    except BaseException:
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    ctx.barrier()


def _damaged(file: Path, what: object) -> ModelFileError:
    return ModelFileError(
        f"{file}: {what} (a damaged checkpoint; resume from another one, "
        "or 'latest', which skips damaged ones)"
    )


def read_trainer_state(folder: Path) -> dict[str, Any]:
    """The parsed ``trainer.json`` of the checkpoint ``folder``.

    Raises:
        ValueError: ``folder`` is not a checkpoint (no ``trainer.json``).
        ModelFileError: ``trainer.json`` is truncated or malformed; the message names it.
    """
    info = folder / "trainer.json"
    if not info.is_file():
        raise ValueError(f"{folder} is not a training checkpoint (no trainer.json)")
    try:
        state = json.loads(info.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _damaged(info, f"not valid JSON ({e})") from None
    if not isinstance(state, dict):
        raise _damaged(info, f"holds a JSON {type(state).__name__}, not an object")
    missing = [k for k in ("step", "samples", "tokens", "scheduler") if k not in state]
    if missing:
        raise _damaged(info, f"lacks {missing}")
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise _damaged(info, f"step must be an int >= 0, got {step!r}")
    return state


def _config_difference(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    keys = sorted(set(saved) | set(current))
    return [
        f"{k}: checkpoint {saved.get(k, '(absent)')!r}, this run {current.get(k, '(absent)')!r}"
        for k in keys
        if saved.get(k) != current.get(k)
    ]


def check_same_model(folder: Path, state: dict[str, Any], model_config: dict[str, Any]) -> None:
    """Refuse to resume ``folder`` into a model of another configuration.

    Compares the ``[model]`` section saved in the checkpoint with this run's: a change
    that keeps every shape (another head count, another position encoding) would otherwise
    load silently and train a different model.

    Raises:
        ValueError: the sections differ; the message lists each differing key.
    """
    saved = state.get("config", {}).get("model") if isinstance(state.get("config"), dict) else None
    if not isinstance(saved, dict):
        return  # an older checkpoint without its config: the weights' shapes are checked
    current = json.loads(json.dumps(model_config))  # tuples as lists, as the file holds them
    diff = _config_difference(saved, current)
    if diff:
        raise ValueError(
            f"{folder} was saved by a model of another configuration ({'; '.join(diff)}); "
            "resume with the checkpoint's [model] section, or start a new out_dir"
        )


def _load_weights(st: Any, folder: Path, model: nn.Module) -> None:
    from safetensors import SafetensorError

    file = folder / "model.safetensors"
    if not file.is_file():
        raise _damaged(file, "missing")
    try:
        missing, unexpected = st.load_model(model, str(file), strict=False)
    except SafetensorError as e:  # truncated or not safetensors (not an OSError)
        raise _damaged(file, f"cannot be read as safetensors ({_one_line(e)})") from None
    except RuntimeError as e:  # a shape differs
        raise ValueError(
            f"{file} does not fit this model: {_one_line(e)}; resume with the checkpoint's "
            "[model] section, or start a new out_dir"
        ) from None
    if missing or unexpected:
        raise ValueError(
            f"{file} does not fit this model: missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)}"
        )


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def load_checkpoint(
    folder: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """Restore weights, optimizer state and RNG from ``folder``; return the trainer state.

    A distributed checkpoint (``dcp/``) loads into one process or several, whatever the
    number that saved it; a one-process checkpoint loads into one process or DDP.

    Raises:
        ValueError: ``folder`` is not a checkpoint, or its weights do not fit ``model``.
        ModelFileError: a file of the checkpoint is missing, truncated or corrupt; the
            message names the file.
    """
    st = _safetensors()
    state = read_trainer_state(folder)
    if (folder / "dcp").is_dir():
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        if optimizer is None:
            from torch.distributed.checkpoint.state_dict import (
                get_model_state_dict,
                set_model_state_dict,
            )

            msd = get_model_state_dict(model)
            dcp.load({"model": msd}, checkpoint_id=str(folder / "dcp"))
            set_model_state_dict(model, msd)
        else:
            msd, osd = get_state_dict(model, optimizer)
            dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=str(folder / "dcp"))
            set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
    else:
        _load_weights(st, folder, model)
        if optimizer is not None:
            file = folder / "optimizer.pt"
            try:
                optimizer.load_state_dict(torch.load(file, weights_only=True))
            except FileNotFoundError:
                raise _damaged(file, "missing") from None
            except (ValueError, KeyError, IndexError) as e:  # another optimizer's layout
                raise ValueError(
                    f"{file} does not fit this run's optimizer: {_one_line(e)}"
                ) from None
            except Exception as e:  # UnpicklingError, EOFError, RuntimeError of a bad zip
                raise _damaged(
                    file, f"cannot be read ({type(e).__name__}: {_one_line(e)})"
                ) from None
    file = folder / "rng.safetensors"
    try:
        rng = st.load_file(str(file))
        cpu = rng["cpu"]
    except Exception as e:
        raise _damaged(file, f"cannot be read ({_one_line(e)})") from None
    try:
        torch.set_rng_state(cpu)
    except (RuntimeError, TypeError) as e:
        raise _damaged(file, f"holds no RNG state ({_one_line(e)})") from None
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return state


_STEP = re.compile(r"step-(\d+)")


def _complete(folder: Path, step: int) -> bool:
    """Whether ``folder`` looks like a whole checkpoint of ``step`` (cheap: no weights read)."""
    try:
        state = read_trainer_state(folder)
    except ValueError:
        return False
    if state["step"] != step:
        return False
    if (folder / "dcp").is_dir():
        return (folder / "dcp" / ".metadata").is_file()
    return all(
        (folder / f).is_file() for f in ("model.safetensors", "optimizer.pt", "rng.safetensors")
    )


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The newest complete ``step-N`` folder under ``out_dir/checkpoints``, or None.

    Only folders named exactly ``step-N`` count (not ``step-3.bak`` nor the temporary
    folders of a save in progress), and only complete ones: a folder whose
    ``trainer.json`` is missing, truncated or names another step, or that lacks a file,
    is skipped with a warning, so a run killed while saving resumes from the checkpoint
    before.
    """
    root = out_dir / "checkpoints"
    if not root.is_dir():
        return None
    steps = []
    for p in root.iterdir():
        m = _STEP.fullmatch(p.name)
        if m and p.is_dir():
            steps.append((int(m.group(1)), p))
    for step, p in sorted(steps, reverse=True):
        if _complete(p, step):
            return p
        log.warning("skipping %s: not a complete checkpoint", p)
    return None
