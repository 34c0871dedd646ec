"""attnlab's decode-attention kernel against a float64 recomputation, and inside ``sdpa``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnlab.backends import decode_attention as dec
from attnlab.backends.sdpa import sdpa_torch

pytestmark = pytest.mark.skipif(dec.decode_status() is not None, reason="no decode kernel")


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    k64 = k.double().repeat_interleave(rep, 1)
    v64 = v.double().repeat_interleave(rep, 1)
    return torch.softmax(q.double() @ k64.transpose(-1, -2) * scale, -1) @ v64


def _inputs(b: int, h: int, g: int, L: int, e: int, ev: int, s: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, L, e, generator=gen) * 2
    # a prefix view of a larger static cache [B, G, T, E]: strided rows and heads
    k = torch.randn(b, g, s + 9, e, generator=gen)[:, :, :s]
    v = torch.randn(b, g, s + 9, ev, generator=gen)[:, :, :s]
    return q, k, v


SHAPES = [  # b, h, h_kv, L, e, ev, s: GQA (SmolLM2's 9/3), MQA, MHA, odd dims, lengths
    (1, 9, 3, 1, 64, 64, 256),
    (8, 9, 3, 1, 64, 64, 300),
    (2, 4, 1, 1, 32, 48, 5),
    (1, 8, 8, 2, 80, 80, 1000),
    (3, 6, 2, 3, 17, 9, 77),
    (1, 4, 4, 1, 128, 128, 4097),
    (1, 16, 1, 1, 64, 64, 1),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("threads", [1, 2])
def test_every_simd_width_matches_float64(shape: tuple[int, ...], threads: int) -> None:
    q, k, v = _inputs(*shape)
    scale = shape[4] ** -0.5
    want = _reference(q, k, v, scale)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)  # 2 threads split long calls into chunks of keys
    try:
        for width in torch.ops.attnlab_dec.simd_widths():
            got = torch.ops.attnlab_dec.decode_attention_simd(q, k, v, scale, width)
            assert got.shape == want.shape and got.is_contiguous()
            torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)
    finally:
        torch.set_num_threads(old)


def test_sdpa_runs_it_for_decode_calls_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unmasked float32 call of one query takes the kernel (the values of torch's);
    a masked, causal, gradient, float64 or longer call does not (a prompt: torch's)."""
    calls: list[tuple[int, ...]] = []
    real = dec.decode_attention

    def spy(q: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(tuple(q.shape))
        return real(q, *args)  # type: ignore[arg-type]

    monkeypatch.setattr("attnlab.backends.sdpa.decode_attention", spy)
    q, k, v = _inputs(2, 9, 3, 1, 64, 64, 40)
    out, _ = sdpa_torch(q, k, v, enable_gqa=True)
    assert calls == [(2, 9, 1, 64)]
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)
    out, w = sdpa_torch(q, k, v, enable_gqa=True, return_weights=True)
    assert w is not None and torch.allclose(w.sum(-1), torch.ones(()))
    mask = torch.ones(1, 1, 1, 40, dtype=torch.bool)
    q2, k2, v2 = _inputs(1, 2, 1, 2, 8, 8, 40)  # two queries
    grad = q.clone().requires_grad_()
    for args, kw in [
        ((q, k, v), {"attn_mask": mask, "enable_gqa": True}),
        ((q, k, v), {"is_causal": True, "enable_gqa": True}),
        ((grad, k, v), {"enable_gqa": True}),
        ((q2, k2, v2), {"enable_gqa": True}),
        ((q.double(), k.double(), v.double()), {"enable_gqa": True}),
    ]:
        calls.clear()
        sdpa_torch(*args, **kw)  # type: ignore[arg-type]
        assert calls == [], kw
    monkeypatch.setenv("ATTNLAB_DECODE_KERNEL", "0")
    calls.clear()
    sdpa_torch(q, k, v, enable_gqa=True)
    assert calls == []
    monkeypatch.delenv("ATTNLAB_DECODE_KERNEL")
    assert dec.decode_status() is None


def test_compiled_call_has_no_graph_break() -> None:
    """In a graph the kernel is an opaque op with a fake kernel (shapes only)."""
    q, k, v = _inputs(1, 9, 3, 1, 64, 64, 33)

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return sdpa_torch(q, k, v, enable_gqa=True, check_finite=False)[0] * 2

    explained = torch._dynamo.explain(step)(q, k, v)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    assert any("attnlab_dec" in str(n.target) for g in explained.graphs for n in g.graph.nodes)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), step(q, k, v), atol=0, rtol=0)
