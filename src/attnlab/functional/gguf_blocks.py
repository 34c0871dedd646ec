"""GGUF/ggml tensor storage: the block layouts, unpacked to integers and per-group scales.

The one place that knows how ggml lays out a tensor's bytes (ggml's ``ggml-common.h``,
``ggml-quants.c``). The GGUF reader dequantizes through it, and quantized layers repack
from it without going through float: :func:`split_blocks` returns the stored integers and
the per-group affine parameters,

    value[g, i] = scales[g] * quants[g, i] + mins[g]        (mins absent: + 0)

with ``quants`` int8 ``[G, group_size]`` holding the format's levels (signed where ggml
centres them: Q4_0 ``-8..7``, Q6_K ``-32..31``; unsigned where a minimum is stored:
Q4_1 ``0..15``), ``scales``/``mins`` float32 ``[G]`` computed exactly as ggml does
(``d * sc`` in float32 for the K-quants), and groups in the tensor's element order (a row
of ``K`` elements is ``K / group_size`` consecutive groups). :func:`dequantize` is
``scales * quants + mins`` reshaped; :func:`join_blocks` is the inverse for the
formats attnlab writes (Q8_0, Q4_0, Q4_1). Every step is a whole-tensor torch operation: no
Python loop over blocks.

Shape notation: ``N`` blocks, ``G`` groups, ``E`` elements per group.

The formats: Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 (Gerganov, llama.cpp, 2023) and the K-quants
Q2_K..Q6_K (Kawrakow, llama.cpp PR #1684, 2023).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch
from torch import Tensor

__all__ = [
    "BlockLayout",
    "GGMLType",
    "QuantBlocks",
    "block_layout",
    "dequantize",
    "ggml_type",
    "join_blocks",
    "split_blocks",
    "tensor_nbytes",
]


class GGMLType(IntEnum):
    """ggml's type ids (``enum ggml_type`` in ``ggml.h``) for the layouts attnlab reads."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30


@dataclass(frozen=True)
class BlockLayout:
    """How one ggml type stores values.

    Attributes:
        block_size: elements per block (1 for the float types).
        type_size: bytes per block.
        group_size: elements sharing one scale (and minimum); 0 for the float types.
        bits: bits per stored level; 0 for the float types.
        has_mins: whether groups carry a minimum (``mins`` in :class:`QuantBlocks`).
    """

    block_size: int
    type_size: int
    group_size: int = 0
    bits: int = 0
    has_mins: bool = False

    @property
    def quantized(self) -> bool:
        return self.group_size > 0


_LAYOUTS: dict[GGMLType, BlockLayout] = {
    GGMLType.F32: BlockLayout(1, 4),
    GGMLType.F16: BlockLayout(1, 2),
    GGMLType.BF16: BlockLayout(1, 2),
    GGMLType.Q8_0: BlockLayout(32, 2 + 32, 32, 8),
    GGMLType.Q4_0: BlockLayout(32, 2 + 16, 32, 4),
    GGMLType.Q4_1: BlockLayout(32, 2 + 2 + 16, 32, 4, True),
    GGMLType.Q5_0: BlockLayout(32, 2 + 4 + 16, 32, 5),
    GGMLType.Q5_1: BlockLayout(32, 2 + 2 + 4 + 16, 32, 5, True),
    GGMLType.Q2_K: BlockLayout(256, 16 + 64 + 2 + 2, 16, 2, True),
    GGMLType.Q3_K: BlockLayout(256, 32 + 64 + 12 + 2, 16, 3),
    GGMLType.Q4_K: BlockLayout(256, 2 + 2 + 12 + 128, 32, 4, True),
    GGMLType.Q5_K: BlockLayout(256, 2 + 2 + 12 + 32 + 128, 32, 5, True),
    GGMLType.Q6_K: BlockLayout(256, 128 + 64 + 16 + 2, 16, 6),
}

_FLOAT_DTYPES = {
    GGMLType.F32: torch.float32,
    GGMLType.F16: torch.float16,
    GGMLType.BF16: torch.bfloat16,
}


def ggml_type(value: int | str | GGMLType) -> GGMLType:
    """The :class:`GGMLType` of an id (``12``) or a name (``"Q4_K"``, ``"q4_k"``).

    Raises:
        ValueError: a type attnlab has no layout for (named, with the supported list).
    """
    try:
        if isinstance(value, str):
            return GGMLType[value.upper()]
        return GGMLType(int(value))
    except (KeyError, ValueError):
        supported = ", ".join(f"{t.name} ({int(t)})" for t in GGMLType)
        raise ValueError(
            f"ggml type {value!r} is not supported; attnlab reads {supported}"
        ) from None


def block_layout(kind: int | str | GGMLType) -> BlockLayout:
    """The :class:`BlockLayout` of a ggml type (id or name)."""
    return _LAYOUTS[ggml_type(kind)]


def tensor_nbytes(kind: int | str | GGMLType, num_elements: int) -> int:
    """Bytes a tensor of ``num_elements`` occupies in ``kind``.

    Raises:
        ValueError: ``num_elements`` is not a whole number of blocks.
    """
    lay = block_layout(kind)
    if num_elements % lay.block_size:
        raise ValueError(
            f"a {ggml_type(kind).name} tensor holds whole blocks of {lay.block_size} elements; "
            f"got {num_elements} elements"
        )
    return num_elements // lay.block_size * lay.type_size


@dataclass(frozen=True)
class QuantBlocks:
    """A quantized tensor's blocks unpacked: ``value = scales[:, None] * quants + mins[:, None]``.

    Attributes:
        kind: the ggml type.
        quants: ``[G, E]`` int8, the stored levels (see the module docstring).
        scales: ``[G]`` float32.
        mins: ``[G]`` float32 added after scaling, or None (the format stores none).
        group_size: ``E``.
        bits: bits per stored level.
    """

    kind: GGMLType
    quants: Tensor
    scales: Tensor
    mins: Tensor | None
    group_size: int
    bits: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The values, flat ``[G * E]``, computed in float32 then cast to ``dtype``."""
        out = self.scales[:, None] * self.quants.to(torch.float32)  # [G, E]
        if self.mins is not None:
            out += self.mins[:, None]
        return out.reshape(-1).to(dtype)


# ------------------------------------------------------------------------- unpacking helpers


def _f16(blocks: Tensor, start: int) -> Tensor:
    """One float16 per block at byte ``start``, as float32 ``[N]``."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16)[:, 0].to(torch.float32)


def _fields(data: Tensor, shifts: tuple[int, ...], width: int) -> Tensor:
    """``[N, k * width]`` bytes read as ``len(shifts)`` bit fields per byte: ``[N, k, len, width]``.

    Field ``s`` of run ``r`` is ``data[:, r * width : (r + 1) * width] >> shifts[s]`` (not
    yet masked): ggml stores a group's low nibbles, then its high nibbles, and so on.
    """
    n = data.shape[0]
    shift = torch.tensor(shifts, dtype=torch.uint8).reshape(1, 1, -1, 1)
    return data.reshape(n, -1, 1, width) >> shift  # [N, k, len(shifts), width]


def _nibbles(data: Tensor, width: int) -> Tensor:
    """Low then high nibbles of each run of ``width`` bytes: ``[N, k * 2 * width]`` uint8."""
    return (_fields(data, (0, 4), width) & 0xF).reshape(data.shape[0], -1)


def _bits(data: Tensor, width: int) -> Tensor:
    """Bit ``b`` of byte ``i`` at position ``b * width + i``: ``[N, 8 * width]`` uint8."""
    return (_fields(data, tuple(range(8)), width) & 1).reshape(data.shape[0], -1)


def _k_scales_mins(packed: Tensor) -> tuple[Tensor, Tensor]:
    """The 8 six-bit scales and minimums of Q4_K/Q5_K from 12 bytes (ggml's get_scale_min_k4)."""
    lo, mid, hi = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], dim=1)
    mins = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=1)
    return scales.to(torch.float32), mins.to(torch.float32)  # [N, 8] each


def _q8_0(b: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    return b[:, 2:34].view(torch.int8), _f16(b, 0)[:, None], None


def _q4_0(b: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    q = _nibbles(b[:, 2:18], 16).view(torch.int8) - 8
    return q, _f16(b, 0)[:, None], None


def _q4_1(b: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    return _nibbles(b[:, 4:20], 16).view(torch.int8), _f16(b, 0)[:, None], _f16(b, 2)[:, None]


def _q5_high(qh: Tensor) -> Tensor:
    """The fifth bits of a Q5_0/Q5_1 block: element ``j`` has bit ``j`` of a little-endian u32."""
    return _bits(qh, 4)[:, _Q5_ORDER]


# _bits lists bit b of byte i at b * 4 + i; element j (bit j of the u32) is byte j // 8, bit j % 8
_Q5_ORDER = torch.tensor([(j % 8) * 4 + j // 8 for j in range(32)])


def _q5_0(b: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    q = (_nibbles(b[:, 6:22], 16) | (_q5_high(b[:, 2:6]) << 4)).view(torch.int8) - 16
    return q, _f16(b, 0)[:, None], None


def _q5_1(b: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    q = (_nibbles(b[:, 8:24], 16) | (_q5_high(b[:, 4:8]) << 4)).view(torch.int8)
    return q, _f16(b, 0)[:, None], _f16(b, 2)[:, None]


def _q2_k(b: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    sc = b[:, 0:16]
    q = (_fields(b[:, 16:80], (0, 2, 4, 6), 32) & 3).reshape(b.shape[0], -1)  # [N, 256]
    d, dmin = _f16(b, 80)[:, None], _f16(b, 82)[:, None]
    return (
        q.view(torch.int8),
        d * (sc & 0xF).to(torch.float32),
        -(dmin * (sc >> 4).to(torch.float32)),
    )


def _q3_k(b: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    n = b.shape[0]
    hmask, qs, packed = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    low = (_fields(qs, (0, 2, 4, 6), 32) & 3).reshape(n, -1)  # [N, 256]
    high = _bits(hmask, 32)  # element e: bit e // 32 of hmask[e % 32]
    q = low.view(torch.int8) - 4 * (1 - high.view(torch.int8))  # the bit set means "no borrow"
    sc_lo = _nibbles(packed[:, 0:8], 8)  # scale k's low four bits
    sc_hi = (_fields(packed[:, 8:12], (0, 2, 4, 6), 4) & 3).reshape(n, -1)  # and its top two
    sc = (sc_lo | (sc_hi << 4)).to(torch.float32) - 32  # [N, 16]
    return q, _f16(b, 108)[:, None] * sc, None


def _q4_k(b: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    sc, mn = _k_scales_mins(b[:, 4:16])
    d, dmin = _f16(b, 0)[:, None], _f16(b, 2)[:, None]
    return _nibbles(b[:, 16:144], 32).view(torch.int8), d * sc, -(dmin * mn)


def _q5_k(b: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    sc, mn = _k_scales_mins(b[:, 4:16])
    d, dmin = _f16(b, 0)[:, None], _f16(b, 2)[:, None]
    q = _nibbles(b[:, 48:176], 32) | (_bits(b[:, 16:48], 32) << 4)
    return q.view(torch.int8), d * sc, -(dmin * mn)


def _q6_k(b: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    n = b.shape[0]
    low = _nibbles(b[:, 0:128], 64)  # per half: 64 low nibbles, then 64 high ones
    high = (_fields(b[:, 128:192], (0, 2, 4, 6), 32) & 3).reshape(n, -1)
    q = (low | (high << 4)).view(torch.int8) - 32
    sc = b[:, 192:208].view(torch.int8).to(torch.float32)  # [N, 16]
    return q, _f16(b, 208)[:, None] * sc, None


_SPLIT = {
    GGMLType.Q8_0: _q8_0,
    GGMLType.Q4_0: _q4_0,
    GGMLType.Q4_1: _q4_1,
    GGMLType.Q5_0: _q5_0,
    GGMLType.Q5_1: _q5_1,
    GGMLType.Q2_K: _q2_k,
    GGMLType.Q3_K: _q3_k,
    GGMLType.Q4_K: _q4_k,
    GGMLType.Q5_K: _q5_k,
    GGMLType.Q6_K: _q6_k,
}


def _as_blocks(raw: Tensor, kind: GGMLType, lay: BlockLayout) -> Tensor:
    if not isinstance(raw, Tensor) or raw.dtype != torch.uint8:
        what = raw.dtype if isinstance(raw, Tensor) else type(raw).__name__
        raise TypeError(f"raw must be a uint8 tensor of a tensor's bytes, got {what}")
    if raw.numel() % lay.type_size:
        raise ValueError(
            f"{kind.name} blocks are {lay.type_size} bytes; got {raw.numel()} bytes, not a "
            "whole number of blocks"
        )
    return raw.reshape(-1, lay.type_size)  # [N, type_size]


def split_blocks(raw: Tensor, kind: int | str | GGMLType) -> QuantBlocks:
    """Unpack a quantized tensor's bytes into levels, scales and minimums (no float values).

    Args:
        raw: the tensor's bytes, a uint8 tensor of any shape (flattened), e.g. one row or
            the whole tensor as the file stores it.
        kind: the ggml type (id or name), one of the quantized types of :class:`GGMLType`.

    Returns:
        :class:`QuantBlocks` with groups in element order.

    Raises:
        TypeError: ``raw`` is not a uint8 tensor.
        ValueError: a float or unknown type, or bytes that are not whole blocks.
    """
    t = ggml_type(kind)
    lay = _LAYOUTS[t]
    if not lay.quantized:
        raise ValueError(f"{t.name} stores plain values, not blocks; use dequantize()")
    blocks = _as_blocks(raw, t, lay)
    quants, scales, mins = _SPLIT[t](blocks)
    groups = blocks.shape[0] * (lay.block_size // lay.group_size)
    return QuantBlocks(
        kind=t,
        quants=quants.reshape(groups, lay.group_size),
        scales=scales.reshape(groups),
        mins=None if mins is None else mins.reshape(groups),
        group_size=lay.group_size,
        bits=lay.bits,
    )


def dequantize(
    raw: Tensor,
    kind: int | str | GGMLType,
    shape: tuple[int, ...] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The values a ggml tensor's bytes stand for.

    Args:
        raw: the tensor's bytes (uint8, any shape; read flat).
        kind: its ggml type (id or name).
        shape: the result's shape in torch order (rows of ``shape[-1]`` elements); default flat.
        dtype: the result's dtype. Quantized blocks are expanded in float32 first.

    Raises:
        TypeError: ``raw`` is not a uint8 tensor.
        ValueError: an unsupported type, bytes that are not whole blocks, or a ``shape``
            whose element count differs from the bytes'.
    """
    t = ggml_type(kind)
    lay = _LAYOUTS[t]
    if lay.quantized:
        flat = split_blocks(raw, t).dequantize(dtype)
    else:
        blocks = _as_blocks(raw, t, lay)
        flat = blocks.reshape(-1).view(_FLOAT_DTYPES[t]).to(dtype)
    if shape is None:
        return flat
    if flat.numel() != _numel(shape):
        raise ValueError(
            f"{raw.numel()} bytes of {t.name} hold {flat.numel()} values, not the "
            f"{_numel(shape)} of shape {tuple(shape)}"
        )
    return flat.reshape(shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# ------------------------------------------------------------------------------- packing


def _f16_bytes(values: Tensor) -> Tensor:
    """float32 ``[N]`` rounded to float16 (as ggml stores ``d`` and ``m``): ``[N, 2]`` uint8."""
    return values.to(torch.float16).contiguous().reshape(-1, 1).view(torch.uint8)


def _nibble_bytes(levels: Tensor) -> Tensor:
    """``[N, 32]`` levels in ``0..15`` -> ggml's ``[N, 16]`` bytes: element ``j`` in the low
    nibble of byte ``j``, element ``j + 16`` in its high nibble."""
    lv = levels.to(torch.uint8)
    return lv[:, :16] | (lv[:, 16:] << 4)


def join_blocks(
    kind: int | str | GGMLType, quants: Tensor, scales: Tensor, mins: Tensor | None = None
) -> Tensor:
    """The bytes of ``[G, 32]`` levels with per-group ``scales`` (and ``mins``) ``[G]``.

    The inverse of :func:`split_blocks` for Q8_0 (``quants`` in ``-127..127``), Q4_0
    (``quants`` in ``-8..7``) and Q4_1 (``quants`` in ``0..15``, ``mins`` given). Scales
    and minimums are stored in float16, as ggml stores them: exact for values read from
    such a file, rounded (as llama.cpp's quantizers round) otherwise.

    Returns:
        ``[G * type_size]`` uint8, the tensor's data in element order.

    Raises:
        ValueError: another type, groups that are not 32 wide, levels out of range, or
            ``mins`` given (or missing) against the format.
    """
    t = ggml_type(kind)
    if t not in (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1):
        raise ValueError(f"join_blocks writes Q8_0, Q4_0 or Q4_1, got {t.name}")
    if quants.dim() != 2 or quants.shape[1] != 32:
        raise ValueError(f"quants must be [groups, 32], got {tuple(quants.shape)}")
    g = quants.shape[0]
    if (mins is not None) != (t == GGMLType.Q4_1):
        raise ValueError(f"{t.name} {'stores' if t == GGMLType.Q4_1 else 'has no'} minimums")
    lo, hi = {GGMLType.Q8_0: (-127, 127), GGMLType.Q4_0: (-8, 7), GGMLType.Q4_1: (0, 15)}[t]
    q = quants.to(torch.int16)
    if g and (int(q.min()) < lo or int(q.max()) > hi):
        raise ValueError(f"{t.name} levels lie in {lo}..{hi}, got {int(q.min())}..{int(q.max())}")
    parts = [_f16_bytes(scales.reshape(g))]
    if t == GGMLType.Q8_0:
        parts.append(q.to(torch.int8).view(torch.uint8))
    elif t == GGMLType.Q4_0:
        parts.append(_nibble_bytes(q + 8))
    else:
        assert mins is not None
        parts += [_f16_bytes(mins.reshape(g)), _nibble_bytes(q)]
    return torch.cat(parts, dim=1).reshape(-1)  # [G, type_size] -> flat
