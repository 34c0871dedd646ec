"""Float linears through laid-out weights: every kernel equals F.linear within float32
rounding, compiles without a graph break, refuses what it cannot do, and remembers its choice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnlab.backends import linear_pack as lp
from attnlab.backends.linear_pack import (
    GEMM_KERNELS,
    MAX_ROWS,
    choose_gemm,
    clear_gemm_memo,
    gemm_unavailable,
    pack_linear,
    static_rows,
    use_gemm,
)

RUNNABLE = [k for k in GEMM_KERNELS if gemm_unavailable(k, torch.float32) is None]
# (N, K): square, wide output (an LM head's shape), wide input (a down projection)
SHAPES = [(48, 48), (200, 40), (24, 96)]


def _bound(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per element: K * eps * (|x| @ |W|^T), the rounding of a dot product of length K."""
    eps = torch.finfo(dtype).eps
    return 2 * x.shape[-1] * eps * (x.double().abs() @ w.double().abs().t()) + 1e-30


def _check_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    ref = x.double() @ w.double().t() + (0 if b is None else b.double())
    err = (y.double() - ref).abs()
    bound = _bound(x, w, torch.float32 if y.dtype == torch.float32 else torch.bfloat16)
    assert bool((err <= bound).all()), f"max error {err.max():.3g} past the bound"


@pytest.mark.parametrize("kernel", RUNNABLE)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_every_kernel_equals_linear(kernel: str, shape: tuple[int, int], bias: bool) -> None:
    n, k = shape
    w = torch.randn(n, k)
    b = torch.randn(n) if bias else None
    p = pack_linear(w, b, rows=(1, 8), kernel=kernel)
    with torch.no_grad():
        # 8 rows: the bucket's own count; 3 and 5: fewer than a bucket (mkl's other kernel);
        # a [2, 4, K] input: leading dims kept; 40 rows: past MAX_ROWS, F.linear by rule
        for x in (torch.randn(8, k), torch.randn(3, k), torch.randn(2, 4, k), torch.randn(40, k)):
            y = p(x)
            assert y.shape == (*x.shape[:-1], n)
            _check_close(y, x, w, b)
    assert p.choices[8].how == "forced" and p.choices[8].chosen == kernel


@pytest.mark.parametrize("kernel", [k for k in ("linear", "mm_t", "mkldnn") if k in RUNNABLE])
def test_bfloat16(kernel: str) -> None:
    w = torch.randn(64, 32).bfloat16()
    x = torch.randn(4, 32).bfloat16()
    with torch.no_grad():
        y = pack_linear(w, rows=(4,), kernel=kernel)(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=2e-2)


def test_compiled_without_graph_break() -> None:
    w, b = torch.randn(80, 32), torch.randn(80)
    packs = [pack_linear(w, b, rows=(4,), kernel=k) for k in RUNNABLE]

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.stack([p(x) * 2.0 for p in packs])  # a pointwise op: a fused kernel too

    x = torch.randn(4, 32)
    with torch.inference_mode(), static_rows():
        want = f(x)
        got = torch.compile(f, fullgraph=True, dynamic=False)(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for y in got:
        _check_close(y / 2.0, x, w, b)


def test_auto_measures_once_per_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_gemm_memo()
    calls: list[tuple[int, ...]] = []
    real = lp._measure

    def counting(n: int, k: int, rows: int, *args: object) -> dict[str, float]:
        calls.append((n, k, rows))
        return real(n, k, rows, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(lp, "_measure", counting)
    monkeypatch.setattr(lp, "_MEASURE_BYTES", 1 << 16)  # few copies: a fast test
    w = torch.randn(40, 24)
    a = pack_linear(w, rows=(1, 2))
    b = pack_linear(torch.randn(40, 24), rows=(2, 1))
    assert calls == [(40, 24, 1), (40, 24, 2)]  # the second layer of the shape: the memo
    c = a.choices[2]
    assert c.how == "measured" and c.chosen in RUNNABLE and b.choices[2] is c
    assert set(c.timings_us) == set(RUNNABLE) and c.chosen in str(c)
    assert c.other_rows != "mkl"
    with torch.no_grad():
        a(torch.randn(2, 24))
    assert a.last is c
    assert choose_gemm(40, 24, 3).rows == 4  # a new bucket measures
    assert choose_gemm(40, 24, MAX_ROWS + 1).how == "rule"
    with use_gemm("linear"):
        assert choose_gemm(40, 24, 2).how == "forced"
    clear_gemm_memo()


def test_weight_written_in_place_is_laid_out_again() -> None:
    w = torch.randn(32, 16)
    p = pack_linear(w, rows=(2,), kernel="mm_t")
    with torch.no_grad():
        w.mul_(-2.0)
        x = torch.randn(2, 16)
        _check_close(p(x), x, w, None)


def test_refusals() -> None:
    w = torch.randn(8, 4, requires_grad=True)
    p = pack_linear(w, rows=(1,), kernel="mm_t")
    with pytest.raises(ValueError, match="needs gradients"):
        p(torch.randn(1, 4))
    with torch.no_grad(), pytest.raises(ValueError, match=r"\[\.\.\., 4\] torch.float32"):
        p(torch.randn(1, 5))
    with pytest.raises(ValueError, match="weight must be float32 or bfloat16, got torch.float16"):
        pack_linear(torch.randn(8, 4).half())
    with pytest.raises(ValueError, match="weight must be a 2-D tensor"):
        pack_linear(torch.randn(8))
    with pytest.raises(ValueError, match="weight must be on the CPU"):
        pack_linear(torch.randn(8, 4, device="meta"))
    with pytest.raises(ValueError, match="bias must be None or a \\[8\\]"):
        pack_linear(torch.randn(8, 4), torch.randn(7))
    with pytest.raises(ValueError, match="rows must be positive ints, got 0"):
        pack_linear(torch.randn(8, 4), rows=(0,))
    with pytest.raises(ValueError, match="kernel 'fast' cannot run: expected 'auto' or one of"):
        pack_linear(torch.randn(8, 4), kernel="fast")
    with pytest.raises(ValueError, match="float32 only"):
        pack_linear(torch.randn(8, 4).bfloat16(), kernel="mkl")


def test_dynamic_graph_is_not_guarded_on_the_row_count() -> None:
    p = pack_linear(torch.randn(64, 32), rows=(4,), kernel="mm_t")
    c = torch.compile(lambda x: p(x) * 2.0, dynamic=True)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.inference_mode():
        for n in (40, 20, 3):  # outside static_rows: F.linear, one graph for every count
            x = torch.randn(n, 32)
            _check_close(c(x) / 2.0, x, p.weight, None)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before + 1
