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
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnlab.train.distributed import DistContext

__all__ = ["latest_checkpoint", "load_checkpoint", "save_checkpoint"]


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
    """Write a checkpoint (every process calls this when distributed).

    Args:
        folder: the checkpoint's folder (created).
        model: the unwrapped model (FSDP2-sharded in place, or plain).
        optimizer: its optimizer.
        state: JSON-able trainer state (step, samples, scheduler, config).
        ctx: the process group context.
    """
    st = _safetensors()
    folder.mkdir(parents=True, exist_ok=True)
    if ctx.enabled:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(folder / "dcp"))
    else:
        st.save_model(model, str(folder / "model.safetensors"))
        torch.save(optimizer.state_dict(), folder / "optimizer.pt")
    if ctx.is_main:
        st.save_file(_rng_state(), str(folder / "rng.safetensors"))
        (folder / "trainer.json").write_text(json.dumps(state, indent=2) + "\n")
    ctx.barrier()


def load_checkpoint(
    folder: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """Restore weights, optimizer state and RNG from ``folder``; return the trainer state.

    A distributed checkpoint (``dcp/``) loads into one process or several, whatever the
    number that saved it; a one-process checkpoint loads into one process or DDP.

    Raises:
        ValueError: ``folder`` is not a checkpoint.
    """
    st = _safetensors()
    info = folder / "trainer.json"
    if not info.is_file():
        raise ValueError(f"{folder} is not a training checkpoint (no trainer.json)")
    state: dict[str, Any] = json.loads(info.read_text())
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
        missing, unexpected = st.load_model(model, str(folder / "model.safetensors"))
        if missing or unexpected:
            raise ValueError(f"{folder}: weights missing {missing}, unexpected {unexpected}")
        if optimizer is not None:
            optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
    rng = st.load_file(str(folder / "rng.safetensors"))
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return state


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The newest ``step-N`` folder under ``out_dir/checkpoints``, or None."""
    root = out_dir / "checkpoints"
    found = [p for p in root.glob("step-*") if (p / "trainer.json").is_file()]
    return max(found, key=lambda p: int(p.name.split("-")[1]), default=None)
