"""The tiled (FlashAttention-style) backend: gradcheck, tile skipping, memory shape."""

from __future__ import annotations

import pytest
import torch

from attnlab.backends import blocks
from attnlab.backends.tiled import tiled_attention, tiled_forward
from attnlab.functional import masks as M
from attnlab.functional import sdpa_reference


@pytest.mark.parametrize(
    ("pattern", "is_causal"),
    [
        (None, False),
        (None, True),
        (M.sliding_window(3, 1), False),
        (M.document([0, 0, 0, 1, 1, 2, 2, 2, 2]) & M.causal(), False),
        (M.global_tokens([1]) | M.dilated(1, 2), True),
    ],
)
def test_gradcheck_float64(pattern: M.MaskPattern | None, is_causal: bool) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 9, 4, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(1, 1, 9, 4, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(1, 1, 9, 3, dtype=torch.float64, generator=g, requires_grad=True)

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, _ = tiled_attention(
            q, k, v, pattern, 0.0, is_causal, None, True, block_q=2, block_k=2, max_span=2
        )
        return out

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_gradcheck_with_float_mask_and_masked_rows() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(1, 1, 6, 3, dtype=torch.float64, generator=g, requires_grad=True)
        for _ in range(3)
    )
    bias = torch.randn(6, 6, dtype=torch.float64, generator=g)
    bias[2] = float("-inf")  # a fully masked row

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return tiled_attention(q, k, v, bias, block_q=4, block_k=2, max_span=2)[0]

    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("max_span", [8, 4096])
def test_skips_tiles_the_pattern_leaves_empty(
    monkeypatch: pytest.MonkeyPatch, max_span: int
) -> None:
    """A window of 4 over 64 positions in 8 x 8 tiles: 2 key tiles per query block at most."""
    visited: list[tuple[int, int]] = []
    real = blocks.masked_scores

    def counting(scores, spec, q0, q1, k0, k1, full):  # type: ignore[no-untyped-def]
        visited.append((k0, k1))
        return real(scores, spec, q0, q1, k0, k1, full)

    monkeypatch.setattr("attnlab.backends.tiled.masked_scores", counting)
    monkeypatch.setattr("attnlab.backends.tiled.MAX_SPAN", max_span)
    q = torch.randn(1, 1, 64, 4)
    spec = blocks.mask_spec(M.sliding_window(3), False, tuple(q.shape), 64)
    tiled_forward(q, q, q, spec, 0.5, block_q=8, block_k=8)
    # the first query block meets its own key tile, every other one two tiles
    assert sum(k1 - k0 for k0, k1 in visited) == 8 + 7 * 16
    assert len(visited) == (8 + 7 if max_span == 8 else 8)  # merged into one span per block


def test_full_tiles_skip_the_element_mask() -> None:
    spec = blocks.mask_spec(None, True, (1, 1, 16, 4), 16)
    needed, full = spec.tiles(4, 4, torch.device("cpu"))
    assert needed.sum() == 10 and full.sum() == 6  # 4 diagonal tiles need a mask


def test_lse_matches_logsumexp() -> None:
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 10, 4, dtype=torch.float64, generator=g) for _ in range(3))
    spec = blocks.mask_spec(None, True, tuple(q.shape), 10)
    _, lse = tiled_forward(q, k, v, spec, 0.5, block_q=3, block_k=4, max_span=4)
    scores = (q @ k.transpose(-1, -2) * 0.5).masked_fill(
        ~M.causal().to_dense(10, 10), float("-inf")
    )
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1))


def test_half_precision_keeps_dtype_and_grads() -> None:
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 12, 8, generator=g).half().requires_grad_() for _ in range(3))
    out, _ = tiled_attention(q, k, v, M.sliding_window(4), block_q=4, block_k=4)
    assert out.dtype == torch.float16
    out.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == torch.float16
    ref, _ = sdpa_reference(
        *(t.detach().float() for t in (q, k, v)), M.sliding_window(4).to_dense(12, 12)
    )
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)
