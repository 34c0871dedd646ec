"""Reading a GGUF file: its metadata, its tensor table, and each tensor's bytes, lazily.

GGUF (ggml's file format, https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) is a
header of typed key/value metadata and a tensor table, then the tensors' data, each at
an aligned offset. :func:`read_gguf` parses the header with ``struct`` and maps the file
(``mmap``, copy-on-write): nothing of the data section is read until a tensor is asked
for, and :meth:`GGUFFile.raw` returns a zero-copy uint8 view of its bytes, which
:mod:`attnlab.functional.gguf_blocks` expands.

Why not the ``gguf`` package's ``GGUFReader``: it builds a numpy view for each part of
every metadata field, which for a 49152-token vocabulary and its merges costs 2.7-3.6 s
on this machine; this parser reads the same header in a small fraction of that, and the
tests check that the two agree on every key and tensor.

Only the standard library, numpy-free, and torch are needed.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnlab.errors import ModelFileError
from attnlab.functional.gguf_blocks import GGMLType, dequantize, ggml_type, tensor_nbytes

__all__ = ["GGUFFile", "GGUFTensorInfo", "read_gguf"]

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# value type id -> struct format, for the fixed-size types (GGUF spec, gguf_metadata_value_type)
_SCALAR = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor table.

    Attributes:
        name: the GGUF name (``blk.0.attn_q.weight``).
        shape: in torch order (rows last-but-one; GGUF lists dimensions fastest first).
        kind: the ggml type.
        offset: absolute byte offset of the data in the file.
        nbytes: bytes of data.
    """

    name: str
    shape: tuple[int, ...]
    kind: GGMLType
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class _Cursor:
    """Bounds-checked little-endian reads from the mapped header."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)

    def fail(self, what: str) -> ModelFileError:
        return ModelFileError(
            f"{self.path}: {what} (at byte {self.pos}); the file is damaged or not GGUF"
        )

    def unpack(self, fmt: str) -> Any:
        width = struct.calcsize(fmt)
        if self.pos + width > self.size:
            raise self.fail("truncated header")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += width
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        end = self.pos + length
        if end > self.size:
            raise self.fail(f"a string of {length} bytes runs past the end of the file")
        try:
            text = self.buf[self.pos : end].decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail("a string is not UTF-8") from None
        self.pos = end
        return text

    def value(self, kind: int) -> Any:
        if kind in _SCALAR:
            return self.unpack(_SCALAR[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            return self.array(item, count)
        raise self.fail(f"unknown metadata value type {kind}")

    def array(self, item: int, count: int) -> list[Any]:
        if item in _SCALAR:
            fmt = _SCALAR[item]
            width = struct.calcsize(fmt)
            if self.pos + width * count > self.size:
                raise self.fail(f"an array of {count} values runs past the end of the file")
            values = list(struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.pos))
            self.pos += width * count
            return values
        if item == _STRING:
            if count > self.size // 8:
                raise self.fail(f"an array claims {count} strings")
            return [self.string() for _ in range(count)]
        if item == _ARRAY:
            return [self.array(self.unpack("<I"), self.unpack("<Q")) for _ in range(count)]
        raise self.fail(f"unknown array element type {item}")


class GGUFFile:
    """A parsed GGUF file: ``metadata``, ``tensors`` (name -> :class:`GGUFTensorInfo`), data on demand.

    Use :func:`read_gguf`. The file stays mapped while this object lives; tensors from
    :meth:`tensor` own their memory, views from :meth:`raw` do not.
    """

    def __init__(
        self,
        path: Path,
        buf: mmap.mmap,
        version: int,
        metadata: dict[str, Any],
        tensors: dict[str, GGUFTensorInfo],
    ) -> None:
        self.path = path
        self.version = version
        self.metadata = metadata
        self.tensors = tensors
        self._buf = buf
        self._bytes = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else None

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "?"))

    def raw(self, name: str) -> Tensor:
        """The bytes of tensor ``name`` as a flat uint8 view (no copy)."""
        info = self._info(name)
        assert self._bytes is not None
        return self._bytes[info.offset : info.offset + info.nbytes]

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> Tensor:
        """Tensor ``name`` dequantized to ``dtype``, in torch's shape order (a new tensor)."""
        info = self._info(name)
        out = dequantize(self.raw(name), info.kind, info.shape, dtype)
        return out.clone() if out.data_ptr() == self.raw(name).data_ptr() else out

    def _info(self, name: str) -> GGUFTensorInfo:
        if name not in self.tensors:
            raise KeyError(f"{self.path} has no tensor {name!r}")
        return self.tensors[name]


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file's header and map its data.

    Raises:
        ModelFileError: missing or unreadable file, not GGUF, an unsupported version, a
            truncated or inconsistent header, a tensor type attnlab cannot read, or a
            tensor whose data lies outside the file.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"{path} does not exist or is not a file; expected a .gguf file")
    try:
        with path.open("rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if path.stat().st_size else None
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{path}: cannot be read: {e}") from None
    if buf is None or buf[:4] != _MAGIC:
        raise ModelFileError(f"{path} is not a GGUF file (it does not start with b'GGUF')")
    cur = _Cursor(buf, path)
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in _VERSIONS:
        raise ModelFileError(f"{path}: GGUF version {version}; attnlab reads versions {_VERSIONS}")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"))
    table = [_tensor_entry(cur) for _ in range(n_tensors)]
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ModelFileError(f"{path}: general.alignment is {alignment}, not a power of two")
    data_start = (cur.pos + alignment - 1) // alignment * alignment
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, shape, kind_id, rel in table:
        try:
            kind = ggml_type(kind_id)
        except ValueError as e:
            raise ModelFileError(f"{path}: tensor {name!r}: {e}") from None
        info = GGUFTensorInfo(name, shape, kind, data_start + rel, 0)
        try:
            nbytes = tensor_nbytes(kind, info.numel)
        except ValueError as e:
            raise ModelFileError(f"{path}: tensor {name!r} of shape {shape}: {e}") from None
        if info.offset + nbytes > len(buf):
            raise ModelFileError(
                f"{path}: tensor {name!r} ({nbytes} bytes at {info.offset}) runs past the end of "
                f"the file ({len(buf)} bytes): the file is truncated"
            )
        tensors[name] = GGUFTensorInfo(name, shape, kind, info.offset, nbytes)
    return GGUFFile(path, buf, version, metadata, tensors)


def _tensor_entry(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string()
    n_dims = cur.unpack("<I")
    if n_dims > 8:
        raise cur.fail(f"tensor {name!r} claims {n_dims} dimensions")
    dims = [cur.unpack("<Q") for _ in range(n_dims)]
    kind, offset = cur.unpack("<I"), cur.unpack("<Q")
    return name, tuple(reversed(dims)), kind, offset
