"""The quantized GEMV kernels (C++ ops ``attnlab_q``): the int8-activation path against a
float64 recomputation of the same arithmetic and against float64 dequantize-then-multiply
with a bound derived from the activations' rounding; the op traced without a graph break."""

from __future__ import annotations

import pytest
import torch

from attnlab.backends import native, qmatmul
from attnlab.backends.qmatmul import explain_linear, use_kernel
from attnlab.functional.quant import quantize_act_q8
from attnlab.modules.quant_linear import Int4Linear, Int8Linear

qc = pytest.importorskip("attnlab.backends.qmatmul_cpu")


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    why = qc.unavailable()
    if why is not None:  # no compiler here: the kernels are not offered (tested below)
        pytest.skip(why)


def _x(m: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(m * 1000 + k)
    x = torch.randn(m, k, generator=g) * torch.rand(m, k // 32, 1, generator=g).repeat(
        1, 1, 32
    ).reshape(m, k)
    x[0, :32] = 0.0  # an all-zero block: d = 0, levels 0
    x[-1, 40] = 1e4  # one large value: its block's other levels round to 0
    return x


def _weights(kind: str, n: int, k: int, g: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(n + k + g)
    s = torch.rand(n, k // g, generator=gen) * 0.02 + 1e-3
    if kind == "int8":
        q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)  # -128 too
        return q, q.double(), s, None
    levels = torch.randint(0, 16, (n, k), generator=gen)
    m = -8 * s * torch.rand(n, k // g, generator=gen)
    return qc.repack_int4(levels), levels.double(), s, m


def test_activation_blocks_follow_llamacpp() -> None:
    x = _x(3, 128)
    x[1, 64:96] = torch.arange(32) - 15.5  # halves: x * 127 / 16.5 ties nowhere, d exact
    q, d, sx = qc.quantize_q8(x)
    rq, rd, rsx = quantize_act_q8(x)
    assert torch.equal(q.float(), rq.reshape(3, 128)) and q.dtype == torch.int8
    assert torch.equal(d, rd[..., 0]) and torch.equal(sx, rsx[..., 0])
    assert int(q.abs().max()) == 127 and bool((q[0, :32] == 0).all()) and float(d[0, 0]) == 0.0
    # d is float16: amax / 127 rounded to 11 significant bits
    assert torch.equal(d, (x.reshape(3, 4, 32).abs().amax(-1) / 127).half().float())


def _q8(op: str, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None,
        g: int) -> torch.Tensor:  # fmt: skip
    """The row kernel (``qgemv_q8``) or the tiled one (``qgemv_q8t`` over ``tile_weights``)."""
    if op == "rows":
        return qc.qgemv_q8(x, q, s, m, g)
    why = qc.tiled_unavailable()
    if why is not None:  # an AVX2 or scalar build: the row kernel alone runs
        pytest.skip(why)
    w, st, mt = qc.tile_weights(q, s, m, g)
    exact16 = all(t is None or bool((t.half().float() == t).all()) for t in (s, m))
    assert st.dtype == (torch.float16 if exact16 else torch.float32)  # GGUF's scales: float16
    return qc.qgemv_q8t(x, w, st, mt, q.shape[0])


@pytest.mark.parametrize("op", ["rows", "tiled", "tiled16"])  # 16: float16-exact scales
@pytest.mark.parametrize("kind,g", [("int8", 32), ("int8", 64), ("int4", 32), ("int4", 64)])
@pytest.mark.parametrize("rows", [1, 7])  # 7: a block of four rows and three more
def test_int8_activations_equal_the_same_arithmetic_in_float64(
    kind: str, g: int, rows: int, op: str
) -> None:
    n, k = 40, 256  # 40: the tiled kernel's last tile of 16 features is part padding
    x = _x(rows, k)
    q, lv, s, m = _weights(kind, n, k, g)
    if op == "tiled16":
        s, m = s.half().float(), None if m is None else m.half().float()
    y = _q8(op.removesuffix("16"), x, q, s, m, g).double()
    xq, d, sx = (t.double() for t in qc.quantize_q8(x))
    b = k // 32
    dots = torch.einsum("rbj,nbj->rnb", xq.reshape(rows, b, 32), lv.reshape(n, b, 32))
    sw = s.double().repeat_interleave(g // 32, 1)  # [N, K/32]
    terms = dots * d[:, None, :] * sw[None]  # [M, N, K/32]
    absdots = torch.einsum(
        "rbj,nbj->rnb", xq.abs().reshape(rows, b, 32), lv.abs().reshape(n, b, 32)
    )
    mags = absdots * d[:, None, :] * sw[None]
    if m is not None:
        mterm = sx[:, None, :] * m.double().repeat_interleave(g // 32, 1)[None]
        terms, mags = terms + mterm, mags + mterm.abs()
    ref = terms.sum(-1)
    # float32 rounding: the block scale's product, the fma per block into lanes whose
    # integer partial sums are exact, the lanes' and accumulators' sums (~K/64 + 8 steps)
    bound = (b + 12) * 2.0**-24 * mags.sum(-1) + 1e-30
    assert bool(((y - ref).abs() <= bound).all()), float(((y - ref).abs() / bound).max())


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_the_tiled_kernel_split_over_threads_equals_the_row_kernel(kind: str) -> None:
    # several tasks of tiles on two threads, the activation blocks quantized in parallel
    n, k, rows = 1000, 576, 20
    x = _x(rows, k)
    q, lv, s, m = _weights(kind, n, k, 32)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a, b = qc.qgemv_q8(x, q, s, m, 32), _q8("tiled", x, q, s, m, 32)
    finally:
        torch.set_num_threads(threads)
    scale = float((x.abs() @ (lv.abs() * s.double().repeat_interleave(32, 1)).T.float()).max())
    assert a.shape == b.shape == (rows, n)
    assert float((a - b).abs().max()) <= 1e-5 * scale


@pytest.mark.parametrize("op", ["rows", "tiled"])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_int8_activations_within_their_rounding_of_dequantize_then_multiply(
    kind: str, op: str
) -> None:
    n, k, g, rows = 48, 192, 32, 3
    x = _x(rows, k)
    q, lv, s, m = _weights(kind, n, k, g)
    w = lv * s.double().repeat_interleave(g, 1)
    if m is not None:
        w = w + m.double().repeat_interleave(g, 1)
    ref = x.double() @ w.T
    y = _q8(op, x, q, s, m, g).double()
    # |x - d q| <= d (1/2 + 127 * 2^-11) per element (half a step, and d's float16
    # rounding); Q8_1's sum is float16 too: |m| * 2^-11 * |d sum q| per block
    d = x.reshape(rows, -1, 32).abs().amax(-1).double() / 127  # [M, K/32]
    e = (d * (0.5 + 127 * 2.0**-11)).repeat_interleave(32, 1)  # [M, K]
    bound = e @ w.abs().T
    if m is not None:
        xq, d16, _ = (t.double() for t in qc.quantize_q8(x))
        bsum = (xq.reshape(rows, -1, 32).sum(-1) * d16).abs()  # [M, K/32]
        bound = bound + 2.0**-11 * bsum @ m.double().abs().repeat_interleave(g // 32, 1).T
    bound = 1.001 * bound + 1e-5 * (x.double().abs() @ w.abs().T)  # + float32 sums
    assert bool(((y - ref).abs() <= bound).all())
    assert float((y - ref).abs().max()) > 0  # the activations were rounded


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_both_int8_kernels_compute_the_same_and_auto_says_which_ran(kind: str) -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 48, bias=False)
    cls = Int8Linear if kind == "int8" else Int4Linear
    layer = cls.from_float(lin, group_size=32, compute="int8")
    x = torch.randn(5, 128)
    tiled = qc.tiled_unavailable() is None
    names = ["q8dot", "q8dequant"] + (["q8tile"] if tiled else [])
    with use_kernel("q8dequant"):
        b = layer(x)
    scale = (x.abs() @ layer.dequantize().abs().T).max()
    for name in names:
        with use_kernel(name):
            a = layer(x)
        assert float((a - b).abs().max()) <= 1e-5 * float(scale), name
    for rows in (1, 64):
        choice = explain_linear(layer, rows, compute="int8")
        assert choice.chosen in names and choice.how == "measured"
        assert choice.activations == "int8" and "int8 activations" in str(choice)
        # where q8tile runs, its tiles are the layer's one layout: auto leaves out q8dot,
        # which reads rows (named, as above, it still runs: it builds them)
        timed = set(names) - ({"q8dot"} if tiled else set())
        assert set(choice.timings_us) == timed
        if tiled:
            assert "one layout" in choice.rejected["q8dot"]
        else:
            assert "AVX-512 VNNI" in choice.rejected["q8tile"]
        assert "fused" in choice.rejected and "compute='int8'" in choice.rejected["fused"]
    assert "q8dot" in explain_linear(layer, 1).rejected  # float policies never take it
    assert "q8tile" in explain_linear(layer, 1).rejected
    with pytest.raises(ValueError, match="q8dot"):
        explain_linear(layer, 1, kernel="q8dot")


def test_a_machine_without_the_kernel_falls_back_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(native._state, "qgemv", "no C++ compiler found to build the kernel")
    monkeypatch.setattr(qmatmul, "_MEMO", {})
    layer = Int8Linear.from_float(torch.nn.Linear(64, 16), group_size=32, compute="int8")
    choice = explain_linear(layer, 1, compute="int8")
    assert choice.chosen == "q8dequant"
    assert choice.rejected["q8dot"] == "no C++ compiler found to build the kernel"
    assert choice.rejected["q8tile"] == "no C++ compiler found to build the kernel"


def test_the_ops_trace_without_a_graph_break() -> None:
    q, _, s, m = _weights("int4", 32, 64, 32)
    q8, _, s8, _ = _weights("int8", 32, 64, 32)

    tiled = qc.tiled_unavailable() is None
    if tiled:
        tw = qc.tile_weights(q, s, m, 32)

    def step(x: torch.Tensor) -> torch.Tensor:
        y = qc.qgemv_q8(x, q, s, m, 32) + qc.qgemv(x, q8, s8, None, 32)
        return y + qc.qgemv_q8t(x, *tw, 32) if tiled else y

    x = torch.randn(2, 64)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), step(x))
    assert qc.int8_dot() in ("avx512_vnni", "avx2", "scalar")
