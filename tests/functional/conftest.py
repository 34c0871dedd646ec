"""What the recurrence tests share: every form of a recurrence (chunked, step, parallel)
against its sequential reference, forward and backward, with per-dtype tolerances."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar

import pytest
import torch

Fn = Callable[..., Sequence[torch.Tensor]]


class Forms:
    """The comparison of a fast form with its reference (a session fixture, ``forms``)."""

    TOL: ClassVar[dict[torch.dtype, dict[str, float]]] = {
        torch.float64: {"atol": 1e-10, "rtol": 1e-10},
        torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    }

    @staticmethod
    def left_pad_mask(b: int, l: int, g: torch.Generator) -> torch.Tensor:
        """A ``[b, l]`` 1/0 mask with up to ``l // 2`` left pads per row."""
        pads = torch.randint(0, max(1, l // 2) + 1, (b,), generator=g)
        return (torch.arange(l)[None] >= pads[:, None]).long()

    @staticmethod
    def grads(
        fn: Fn, inputs: list[torch.Tensor], weights: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Gradients of ``sum(out * w)`` over ``fn``'s outputs, w.r.t. each input (zeros
        where an input is unused)."""
        leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
        outs = fn(*leaves)
        loss = sum((o * w).sum() for o, w in zip(outs, weights))
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        return [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]

    def assert_equal(
        self, ref: Fn, fast: Fn, inputs: list[torch.Tensor], dtype: torch.dtype, g: torch.Generator
    ) -> None:
        """``fast`` equals ``ref`` on ``inputs``: every output, and the gradients of a
        random weighting of them."""
        outs_ref = ref(*inputs)
        for a, b in zip(fast(*inputs), outs_ref):
            torch.testing.assert_close(a, b, **self.TOL[dtype])
        weights = [torch.randn(o.shape, generator=g, dtype=dtype) for o in outs_ref]
        for a, b in zip(self.grads(fast, inputs, weights), self.grads(ref, inputs, weights)):
            torch.testing.assert_close(a, b, **self.TOL[dtype])


@pytest.fixture(scope="session")
def forms() -> Forms:
    return Forms()
