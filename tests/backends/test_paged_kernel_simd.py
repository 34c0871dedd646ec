"""Every SIMD path of the ``paged_kernel`` C++ kernel (AVX-512, AVX2+FMA, scalar: those
the build holds) equals a float64 recomputation of the same attention: causal and
sliding-window patterns, MHA/GQA/MQA, head dims that are not whole vectors, every block
size against the kernel's 32-key tiles, decode, draft and chunk queries, ragged rows with
left-padded offsets and freed blocks; and its polynomial ``exp`` is within 2 ulp."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from attnlab.backends import native

ATOL = 2e-5  # float32 sums of up to 64 products over up to ~60 keys, against float64


@pytest.fixture(scope="module")
def op() -> Any:
    reason = native.paged_status()
    if reason is not None and "no C++ compiler" in reason:
        pytest.skip(reason)
    assert reason is None, reason
    return torch.ops.attnlab_paged


def _reference(
    q: torch.Tensor,
    kp: torch.Tensor,
    vp: torch.Tensor,
    rows: list[tuple[list[int], int, int, int]],
    q_pos: torch.Tensor,
    scale: float,
    window: int,
    bs: int,
) -> torch.Tensor:
    """float64 attention of each row over its keys, gathered slot by slot."""
    b_, h_, L, _ = q.shape
    rep = h_ // kp.shape[1]
    out = torch.zeros(b_, h_, L, vp.shape[-1], dtype=torch.float64)
    for b, (blocks, length, offset, first) in enumerate(rows):
        slots = torch.tensor([blocks[j // bs] * bs + j % bs for j in range(length)])
        # [H, n, E], [H, n, Ev]; the freed keys' NaN zeroed (masked below, never read)
        k = kp[slots].double().nan_to_num(0.0).repeat_interleave(rep, 1).transpose(0, 1)
        v = vp[slots].double().nan_to_num(0.0).repeat_interleave(rep, 1).transpose(0, 1)
        j = torch.arange(length)[None]
        t = q_pos[b][:, None] - offset  # [L, 1]
        ok = (j >= first * bs) & (j <= t)
        if window >= 0:
            ok &= j >= t - window
        s = (q[b].double() @ k.transpose(1, 2)) * scale  # [H, L, n]
        s = s.masked_fill(~ok, -math.inf)
        p = torch.softmax(s, -1).nan_to_num(0.0)  # a query that sees no key: zeros
        out[b] = p @ v
    return out


@pytest.mark.parametrize("dims", [(9, 3, 64, 64), (4, 4, 8, 10), (6, 1, 16, 16), (4, 2, 17, 33)])
@pytest.mark.parametrize("bs", [1, 3, 16, 64])
def test_every_simd_path_equals_float64_attention(op: Any, dims: tuple, bs: int) -> None:
    h, h_kv, e, ev = dims
    g = torch.Generator().manual_seed(bs * 100 + h)
    lengths, offsets = [37, 1, 70, 8, 33], [0, 4, 0, 2, 0]
    firsts = [0, 0, 40 // bs, 0, 0]  # row 2 has freed the blocks below key 40
    nb = max(-(-n // bs) for n in lengths)
    n_blocks = len(lengths) * nb + 1
    kp = torch.randn(n_blocks * bs, h_kv, e, generator=g)
    vp = torch.randn(n_blocks * bs, h_kv, ev, generator=g)
    perm = torch.randperm(n_blocks, generator=g).tolist()
    tables = [perm[i * nb : (i + 1) * nb] for i in range(len(lengths))]
    for t, f in zip(tables, firsts):  # a freed block is never read: NaN there is harmless
        for blk in t[:f]:
            kp[blk * bs : (blk + 1) * bs] = float("nan")
            vp[blk * bs : (blk + 1) * bs] = float("nan")
    table = torch.tensor(tables)
    meta = torch.tensor(list(zip(lengths, offsets, firsts)))
    rows = list(zip(tables, lengths, offsets, firsts))
    for L in (1, 2, 5, 16, 21):  # decode, a draft, a chunk, a whole query tile, and more
        q_pos = torch.tensor(
            [[o + max(n - L + j, 0) for j in range(L)] for n, o in zip(lengths, offsets)]
        )
        q = torch.randn(len(lengths), h, L, e, generator=g) * 2
        for window in (-1, 3, 40):
            want = _reference(q, kp, vp, rows, q_pos, 0.3, window, bs)
            for width in op.simd_widths():
                out = torch.full((len(lengths), h, L, ev), float("nan"))
                op.paged_attention_simd(q, kp, vp, table, q_pos, meta, 0.3, window, bs, out, width)
                where = f"width {width}, L {L}, window {window}"
                torch.testing.assert_close(
                    out.double(), want, atol=ATOL, rtol=ATOL, msg=lambda m, w=where: f"{w}: {m}"
                )


def test_strided_queries_and_a_broadcast_position_row(op: Any) -> None:
    # queries as a projection hands them over ([B, L, H, E] transposed), one q_pos row
    g = torch.Generator().manual_seed(3)
    kp, vp = torch.randn(64, 3, 64, generator=g), torch.randn(64, 3, 64, generator=g)
    table = torch.tensor([[3, 1, 0, 2], [2, 0, 3, 1]])
    meta = torch.tensor([[50, 0, 0], [50, 0, 0]])
    q = torch.randn(2, 7, 9, 64, generator=g).transpose(1, 2)  # [2, 9, 7, 64], strided
    q_pos = torch.arange(43, 50)[None]
    want = _reference(
        q,
        kp,
        vp,
        [([3, 1, 0, 2], 50, 0, 0), ([2, 0, 3, 1], 50, 0, 0)],
        q_pos.expand(2, 7),
        0.125,
        -1,
        16,
    )
    for width in op.simd_widths():
        out = torch.empty(2, 9, 7, 64)
        op.paged_attention_simd(q, kp, vp, table, q_pos, meta, 0.125, -1, 16, out, width)
        torch.testing.assert_close(out.double(), want, atol=ATOL, rtol=ATOL)


def test_the_polynomial_exp_is_within_two_ulp(op: Any) -> None:
    x = torch.cat([torch.linspace(-87.3, 88.3, 1 << 20), torch.linspace(-1.0, 0.0, 1 << 16)])
    x = x[: x.numel() // 16 * 16]
    want = torch.exp(x.double())
    special = torch.tensor(
        [0.0, -float("inf"), float("nan"), -88.0, -100.0, -1e30, 1e-30, -1e-30] * 2
    )
    for width in op.simd_widths():
        got = op.vexp(x, width).double()
        rel = ((got - want).abs() / want).max().item()
        assert rel < 2 * 2.0**-23, (width, rel)  # documented: about 1 ulp measured
        s = op.vexp(special, width)
        assert s[0] == 1.0  # the row's largest score weighs exactly 1
        assert s[1] == 0.0 and s[2].isnan() and s[4] == 0.0 and s[5] == 0.0
        assert 0.0 <= s[3] < 2.0**-126  # below 2^-126: flushed to 0 (or the subnormal)
        assert s[6] == 1.0 and s[7] == 1.0


def test_an_unknown_width_is_refused(op: Any) -> None:
    with pytest.raises(RuntimeError, match="SIMD width 3 is not in this build"):
        op.vexp(torch.zeros(4), 3)
