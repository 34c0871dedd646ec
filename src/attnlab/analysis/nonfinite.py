"""Find the first module whose output holds NaN or Inf: :class:`NonFiniteWatch`.

Forward hooks on every module check each output tensor with one float32 sum (NaN and Inf
propagate into it) and record the first module, in execution order innermost first,
whose output is not finite, with statistics of its inputs and the parameters in it that
are not finite. :func:`~attnlab.analysis.diagnostics.diagnose` and the training guard
(:mod:`attnlab.train.guard`) use it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["NonFiniteWatch", "tensor_stats"]


def _tensors(x: Any) -> Iterator[Tensor]:
    """Every tensor in a (nested) output: tensors, tuples, lists, dicts, dataclasses."""
    if isinstance(x, Tensor):
        yield x
    elif isinstance(x, list | tuple):
        for v in x:
            yield from _tensors(v)
    elif isinstance(x, Mapping):
        for v in x.values():
            yield from _tensors(v)
    elif hasattr(x, "__dataclass_fields__"):
        for name in x.__dataclass_fields__:
            yield from _tensors(getattr(x, name))


def _finite(t: Tensor) -> bool:
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return True
    # NaN and Inf propagate into a float32 sum; one reduction and one sync per tensor.
    return bool(torch.isfinite(t.detach().sum(dtype=torch.float32)))


def tensor_stats(t: Tensor) -> dict[str, Any]:
    """Shape, dtype, NaN/Inf counts and the range of the finite values of ``t``."""
    d: dict[str, Any] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
    if not t.is_floating_point():
        return d
    x = t.detach().float()
    finite = torch.isfinite(x)
    d["nan"] = int(torch.isnan(x).sum())
    d["inf"] = int(torch.isinf(x).sum())
    if bool(finite.any()):
        vals = x[finite]
        d["min"] = float(vals.min())
        d["max"] = float(vals.max())
        d["mean"] = float(vals.mean())
        d["abs_max"] = float(vals.abs().max())
    return d


class NonFiniteWatch:
    """Forward hooks that remember the first module whose output is not finite.

    Use as a context manager around a forward pass::

        with NonFiniteWatch(model) as watch:
            model(**inputs)
        watch.first_module  # "layers.3.feed_forward.fc_in" or None

    Forward hooks run when a module returns, so children report before their parents:
    the first name recorded is the innermost module that produced the NaN/Inf. Also
    tracks which module is running (for exceptions) with pre-hooks.

    Args:
        model: the module to watch (every submodule is hooked).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.first_module: str | None = None
        self.first_inputs: list[dict[str, Any]] = []
        self.first_outputs: list[dict[str, Any]] = []
        self.stack: list[str] = []
        self._args: list[Any] = []
        self._recent: deque[Tensor] = deque(maxlen=4)
        self.deepest_on_error: str | None = None
        self._handles: list[Any] = []

    def __enter__(self) -> NonFiniteWatch:
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._pre(name)))
            self._handles.append(module.register_forward_hook(self._post(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None and self.stack:
            self.deepest_on_error = self.stack[-1]
        self._recent.clear()
        self._args.clear()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _finite_once(self, t: Tensor) -> bool:
        """``_finite(t)``, skipping a tensor just checked (a container often returns its last
        child's output). The few recent tensors are held, so their ids cannot be reused."""
        if any(t is c for c in self._recent):
            return True
        ok = _finite(t)
        self._recent.append(t)
        return ok

    def _pre(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self.stack.append(name)
            self._args.append(args)

        return hook

    def _post(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.stack and self.stack[-1] == name:
                self.stack.pop()
                self._args.pop()
            if self.first_module is not None:
                return
            if all(self._finite_once(t) for t in _tensors(output)):
                return
            culprit, culprit_args = name, args
            if self.stack and not all(_finite(t) for t in _tensors(args)):
                # Its input was already bad, yet no child module produced it: the code of
                # the enclosing module that is still running did (e.g. a fused projection).
                culprit, culprit_args = self.stack[-1], self._args[-1]
            self.first_module = culprit or "<model>"
            self.first_inputs = [tensor_stats(t) for t in _tensors(culprit_args)]
            self.first_outputs = [tensor_stats(t) for t in _tensors(output)]

        return hook
