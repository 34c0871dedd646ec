"""The non-finite guard of training and distillation: stop at the first NaN or infinity.

A step whose loss or gradient norm is not finite is stopped before the optimizer moves
the weights, with a :class:`~attnlab.errors.NonFiniteError` that names the step, the
loss and gradient norm, the first module whose output held NaN/Inf (found by re-running
the step's forward under :class:`~attnlab.analysis.diagnostics.NonFiniteWatch`, the
machinery of ``attnlab diagnose``), the parameters holding non-finite values or
gradients, and the last checkpoint (left as it was). Weights are also checked before
each checkpoint is written, so a saved checkpoint never holds NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from attnlab.errors import NonFiniteError

__all__ = ["check_step_finite", "check_weights_finite"]


def _names(found: list[str], limit: int = 4) -> str:
    more = f" and {len(found) - limit} more" if len(found) > limit else ""
    return ", ".join(found[:limit]) + more


@torch.no_grad()
def _nonfinite_parameters(model: nn.Module) -> list[str]:
    return [
        n
        for n, p in model.named_parameters()
        if p.is_floating_point() and not bool(torch.isfinite(p).all())
    ]


@torch.no_grad()
def _nonfinite_gradients(model: nn.Module) -> list[str]:
    return [
        n
        for n, p in model.named_parameters()
        if p.grad is not None and not bool(torch.isfinite(p.grad).all())
    ]


def _first_module(model: nn.Module, rerun: Callable[[], Any]) -> str | None:
    """The first module whose output is not finite when ``rerun()`` runs the forward."""
    from attnlab.analysis.diagnostics import NonFiniteWatch

    was_training = model.training
    try:
        with torch.no_grad(), NonFiniteWatch(model) as watch:
            rerun()
    except Exception:  # the diagnosis must never hide the error it explains
        return None
    finally:
        model.train(was_training)
    return watch.first_module


def check_step_finite(
    *,
    what: str,
    step: int,
    loss: float,
    grad_norm: float,
    model: nn.Module,
    rerun: Callable[[], Any] | None = None,
    last_checkpoint: str | None = None,
    advice: str = "lower the learning rate, or check the data and the initial weights",
) -> None:
    """Raise if the step's loss or gradient norm is not finite (before ``optimizer.step``).

    Args:
        what: the work, for the message (``"training"``, ``"distillation"``).
        step: the step that failed (1-based, as the logs count).
        loss: the step's loss.
        grad_norm: the global gradient norm.
        model: the (unwrapped) model, for naming modules and parameters.
        rerun: runs the step's forward again (no gradient), to find the first module
            whose output is not finite; called only when the step failed. None to skip.
        last_checkpoint: the last checkpoint written, named in the message.
        advice: what to try, for the message.

    Raises:
        NonFiniteError: the loss or gradient norm is NaN or infinite.
    """
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    parts = [
        f"{what} stopped at step {step}: the loss is {loss:g}, the gradient norm {grad_norm:g}"
    ]
    if rerun is not None:
        first = _first_module(model, rerun)
        if first is not None:
            parts.append(f"the first module whose output is not finite: {first}")
    bad_weights = _nonfinite_parameters(model)
    if bad_weights:
        parts.append(f"non-finite weights in {_names(bad_weights)}")
    elif math.isfinite(loss):
        bad_grads = _nonfinite_gradients(model)
        if bad_grads:
            parts.append(f"non-finite gradients of {_names(bad_grads)}")
    parts.append("the weights were not updated")
    if last_checkpoint is not None:
        parts.append(f"the last good checkpoint is {last_checkpoint}")
    raise NonFiniteError("; ".join(parts) + f" ({advice})")


def check_weights_finite(
    model: nn.Module, *, what: str, step: int, last_checkpoint: str | None = None
) -> None:
    """Raise if a weight of ``model`` is NaN or infinite (before it is saved).

    Raises:
        NonFiniteError: naming the step, the parameters and the last checkpoint.
    """
    bad = _nonfinite_parameters(model)
    if bad:
        last = "" if last_checkpoint is None else f"; the last good checkpoint is {last_checkpoint}"
        raise NonFiniteError(
            f"{what} stopped at step {step}: non-finite weights in {_names(bad)}; "
            f"they were not saved{last} (lower the learning rate, or check the initial weights)"
        )
