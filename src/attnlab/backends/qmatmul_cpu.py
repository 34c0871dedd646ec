"""A fused dequantize-and-multiply CPU kernel for a few rows of activations (decoding).

torch's weight-only kernels are built for GEMM shapes: at one row (a decode step) the
grouped int8 layout of GGUF's Q8_0 needs one ``_weight_int8pack_mm`` call per group of 32
input features, and the int4 kernel works in bfloat16 only to be fast. This kernel reads
the quantized blocks once, expands each group of 32 levels in registers and accumulates
in float32, for every output feature in parallel (over ``N``):

``y[r, n] = sum_g s[n, g] * sum_{j<32} x[r, 32 g + j] * q[n, 32 g + j] (+ m[n, g] * sum_j x[r, 32 g + j])``

for int8 levels (Q8_0 and per-channel int8: the scale of a group of any multiple of 32)
and 4-bit levels (Q4_0/Q4_1 and int4 in groups of 32/64/128...), whose bytes are repacked
once into GGUF's order inside a block of 32 (byte ``j`` holds element ``j`` in its low
nibble and element ``j + 16`` in its high one), so the loop needs no shuffle.

The kernels are C++ torch ops (``csrc/qgemv.cpp``, ``torch.ops.attnlab_q``), built once
per machine and cached by :mod:`attnlab.backends.native` (the way the paged-attention
kernel is), parallel over ``N`` on torch's intra-op threads. No Python runs inside a
call, and each op has a fake (shape-only) implementation, so a compiled decode step calls
it without a graph break. Where no compiler is found, the build fails, or
``ATTNLAB_NO_KERNELS=1``, :func:`unavailable` says why and the kernels are not offered.

:func:`qgemv_q8` multiplies with **int8 activations**, as llama.cpp does for quantized
weights on the CPU (``ggml/src/ggml-cpu/arch/x86/quants.c``, ``quantize_row_q8_0``/
``quantize_row_q8_1`` and ``ggml_vec_dot_q8_0_q8_0``/``ggml_vec_dot_q4_1_q8_1``): each
row of ``x`` is quantized once per call into blocks of 32, ``d = amax / 127`` kept in
float16, ``q = round_half_even(x * (127 / amax))``, and for 4-bit weights
``sx = fp16(d * sum q)``; then per block an exact int32 dot product (AVX-512 VNNI
``vpdpbusd`` where the build has it, AVX2 ``vpmaddubsw``/``vpmaddwd`` otherwise) and
``y[r, n] = sum_b sw[n, g(b)] * d[r, b] * dot_b (+ mw[n, g(b)] * sx[r, b])``.
:func:`quantize_q8` returns those activation blocks (for references).

:func:`qgemv_q8t` computes the same numbers (up to float32 summation order) from weights
interleaved once by :func:`tile_weights` in tiles of 16 output features
(``csrc/qgemv_tiled.cpp``): one 512-bit ``vpdpbusd`` with 4 activation bytes broadcast
accumulates a block's dot product for all 16 features, about 2.5 instructions per 64
weight bytes against 13 for the row layout, and rows in fours reuse each loaded weight
register (prefill). It needs an AVX-512 VNNI build (:func:`tiled_unavailable` says why not).

Shape notation: ``M`` rows of activations, ``K`` input features, ``N`` output features,
``G`` the scales' group size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.backends import native

__all__ = [
    "int8_dot",
    "qgemv",
    "qgemv_q8",
    "qgemv_q8t",
    "quantize_q8",
    "repack_int4",
    "tile_weights",
    "tiled_unavailable",
    "unavailable",
    "unpack_int4",
    "untile_levels",
    "untile_scales",
]


def unavailable() -> str | None:
    """Why the kernels cannot run on this machine, or None (builds them on first call;
    inside a compiled graph only the verdict of an earlier eager call is read)."""
    if "qgemv" not in native._state and torch.compiler.is_compiling():
        return "the quantized kernels are built eagerly, before a graph is traced"
    why = native.kernel_status("qgemv")
    if why is None:
        _register_fakes()
    return why


def int8_dot() -> str:
    """The int8 dot product the build uses: ``"avx512_vnni"``, ``"avx2"`` or ``"scalar"``."""
    _require()
    return str(torch.ops.attnlab_q.int8_dot())


_FAKES: list[bool] = []


def _register_fakes() -> None:
    """Shape-only implementations of the ops, for tracing (registered once)."""
    if _FAKES:
        return
    _FAKES.append(True)

    def gemv(x: Tensor, q: Tensor, s: Tensor, m: Tensor | None, group_size: int) -> Tensor:
        return x.new_empty(x.shape[0], s.shape[0])

    def quant(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b = x.shape[1] // 32
        return (
            x.new_empty(x.shape, dtype=torch.int8),
            x.new_empty(x.shape[0], b),
            x.new_empty(x.shape[0], b),
        )

    def gemv_t(x: Tensor, w: Tensor, s: Tensor, m: Tensor | None, n_out: int) -> Tensor:
        return x.new_empty(x.shape[0], n_out)

    if native.kernel_status("qtiled") is None:
        torch.library.register_fake("attnlab_qt::qgemv_q8t", gemv_t)
    torch.library.register_fake("attnlab_q::qgemv", gemv)
    torch.library.register_fake("attnlab_q::qgemv_q8", gemv)
    torch.library.register_fake("attnlab_q::quantize_q8", quant)


def _require() -> None:
    why = unavailable()
    if why is not None:
        raise RuntimeError(why)


def repack_int4(levels: Tensor) -> Tensor:
    """Levels ``[N, K]`` in ``0..15`` -> ``[N, K/2]`` uint8 in GGUF's in-block order
    (byte ``j`` of a block of 32: element ``j`` low, ``j + 16`` high)."""
    n, k = levels.shape
    blocks = levels.to(torch.uint8).reshape(n, k // 32, 2, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(q: Tensor) -> Tensor:
    """The inverse of :func:`repack_int4`: ``[N, K/2]`` bytes -> levels ``[N, K]`` uint8."""
    blocks = q.reshape(q.shape[0], -1, 16)  # [N, K/32, 16]: element j low, j + 16 high
    return torch.cat([blocks & 15, blocks >> 4], dim=-1).reshape(q.shape[0], -1)


def qgemv(x: Tensor, q: Tensor, s: Tensor, m: Tensor | None, group_size: int) -> Tensor:
    """``x [M, K] @ W^T -> [M, N]`` in float32 (float32 activations), ``W`` as the
    kernel reads it.

    Args:
        x: float32 activations ``[M, K]``, contiguous.
        q: int8 levels ``[N, K]``, or 4-bit levels ``[N, K/2]`` uint8 from :func:`repack_int4`.
        s: float32 scales ``[N, K/G]``.
        m: float32 minimums ``[N, K/G]`` for 4-bit levels, None for int8.
        group_size: ``G``, a multiple of 32 dividing ``K``.

    Raises:
        RuntimeError: the kernels are unavailable (the reason), or arguments of the wrong
            dtype or shape (the op's check, naming them).
    """
    if not torch.compiler.is_compiling():
        _require()
    return torch.ops.attnlab_q.qgemv(x, q, s, m, group_size)


def qgemv_q8(x: Tensor, q: Tensor, s: Tensor, m: Tensor | None, group_size: int) -> Tensor:
    """:func:`qgemv` with ``x`` quantized to int8 blocks of 32 first (llama.cpp's Q8_0 /
    Q8_1 activations) and exact int8 dot products per block: same arguments."""
    if not torch.compiler.is_compiling():
        _require()
    return torch.ops.attnlab_q.qgemv_q8(x, q, s, m, group_size)


def quantize_q8(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``x [M, K]`` float32 -> levels ``[M, K]`` int8, scales ``d [M, K/32]`` (float16
    values as float32) and ``sx = fp16(d * sum q)`` ``[M, K/32]``: the activation blocks
    :func:`qgemv_q8` multiplies."""
    _require()
    q, d, sx = torch.ops.attnlab_q.quantize_q8(x)
    return q, d, sx


_TILED: dict[str, str | None] = {}


def tiled_unavailable() -> str | None:
    """Why :func:`qgemv_q8t` cannot run here (no kernels, or a build without AVX-512
    VNNI), or None (builds the kernel on first call; inside a compiled graph only the
    verdict of an earlier eager call is read)."""
    why = unavailable()
    if why is not None:
        return why
    if "verdict" not in _TILED:
        if torch.compiler.is_compiling():
            return "the quantized kernels are built eagerly, before a graph is traced"
        why = native.kernel_status("qtiled")
        if why is None and not bool(torch.ops.attnlab_qt.available()):
            why = "the tiled int8 kernel needs AVX-512 VNNI; this build has " + int8_dot()
        _TILED["verdict"] = why
    return _TILED["verdict"]


def _tiles(t: Tensor, n: int) -> Tensor:
    """``[N, ...]`` padded with zeros to a multiple of 16 rows -> ``[N/16, 16, ...]``."""
    pad = (-n) % 16
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.reshape(-1, 16, *t.shape[1:])


def tile_weights(
    q: Tensor, s: Tensor, m: Tensor | None, group_size: int
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The weights of :func:`qgemv_q8` (int8 ``q [N, K]``, or 4-bit ``[N, K/2]`` from
    :func:`repack_int4`; ``s``/``m [N, K/G]``) interleaved for :func:`qgemv_q8t`:
    levels ``[T, B, 8 | 4, 16, 4]`` uint8 (int8 levels stored as ``w + 128``), scales and
    mins ``[T, B, 16]`` per block of 32 (``T = ceil(N / 16)``, ``B = K / 32``), float16
    when every scale and minimum is exactly a float16 (a GGUF file's are), else float32."""
    n = q.shape[0]
    per = group_size // 32
    if m is None:
        u = (q.to(torch.int16) + 128).to(torch.uint8)  # [N, K]
        b = u.shape[1] // 32
        lv = _tiles(u, n).reshape(-1, 16, b, 8, 4).permute(0, 2, 3, 1, 4)
    else:
        b = q.shape[1] // 16
        lv = _tiles(q, n).reshape(-1, 16, b, 4, 4).permute(0, 2, 3, 1, 4)

    # float16 where it is exact (GGUF stores its scales so): fewer bytes streamed per token
    exact = all(t is None or bool((t.half().float() == t).all()) for t in (s, m))
    dtype = torch.float16 if exact else torch.float32

    def per_block(t: Tensor) -> Tensor:  # [N, K/G] -> [T, B, 16]
        return _tiles(t.to(dtype).repeat_interleave(per, 1), n).transpose(1, 2).contiguous()

    return lv.contiguous(), per_block(s), None if m is None else per_block(m)


def _tile_rows(t: Tensor, ids: Tensor | None, n: int) -> Tensor:
    """Tiles (levels ``[T, B, 8 | 4, 16, 4]`` or scales ``[T, B, 16]``) -> rows ``[N, B, ...]``
    (or ``[len(ids), B, ...]``)."""
    lane = 3 if t.dim() == 5 else 2  # where the 16 features of a tile lie
    if ids is None:
        rows = t.movedim(lane, 1)  # [T, 16, B, ...]
        return rows.reshape(-1, *rows.shape[2:])[:n]
    tile, feature = ids // 16, ids % 16
    return t[tile, :, :, feature] if lane == 3 else t[tile, :, feature]


def untile_levels(lv: Tensor, n: int, ids: Tensor | None = None) -> Tensor:
    """The inverse of :func:`tile_weights` on the levels: int8 ``q [N, K]`` (from ``w + 128``
    tiles ``[T, B, 8, 16, 4]``), or 4-bit bytes ``[N, K/2]`` in :func:`repack_int4`'s GGUF
    order (from ``[T, B, 4, 16, 4]``); only rows ``ids`` when given. Exact."""
    rows = _tile_rows(lv, ids, n)  # [R, B, 8 | 4, 4]
    rows = rows.reshape(rows.shape[0], -1)
    return (rows.to(torch.int16) - 128).to(torch.int8) if lv.shape[2] == 8 else rows


def untile_scales(
    st: Tensor, n: int, group_size: int, dtype: torch.dtype, ids: Tensor | None = None
) -> Tensor:
    """The inverse of :func:`tile_weights` on scales or mins: ``[T, B, 16]`` per block ->
    ``[N, K/G]`` in ``dtype`` (rows ``ids`` when given). Exact: the tiles hold float16 only
    where every value is one."""
    return _tile_rows(st, ids, n)[:, :: group_size // 32].to(dtype)


def qgemv_q8t(x: Tensor, w: Tensor, s: Tensor, m: Tensor | None, n_out: int) -> Tensor:
    """``x [M, K]`` float32 times the weights of :func:`tile_weights` -> ``[M, N]``, int8
    activation blocks as :func:`qgemv_q8` (the same numbers up to float32 summation order).

    Raises:
        RuntimeError: the tiled kernel is unavailable (the reason), or arguments of the
            wrong dtype or shape (the op's check, naming them).
    """
    if not torch.compiler.is_compiling():
        why = tiled_unavailable()
        if why is not None:
            raise RuntimeError(why)
    return torch.ops.attnlab_qt.qgemv_q8t(x, w, s, m, n_out)
