"""Weight-only quantized linear layers (int8, grouped int4) and a quantized embedding table.

The weights are buffers in the layouts of :mod:`attnlab.functional.quant` (the GGUF
Q8_0/Q4_0/Q4_1 layouts among them); the matmul runs in the kernel
:mod:`attnlab.backends.qmatmul` picks (``kernel="auto"``: by measurement per shape) and
the layer remembers which ran (``last_choice``). Each layer has ``dequantize()``, its
weights in float, for references and for code that needs a matrix.

Shape notation: ``N`` output features, ``K`` input features, ``G`` group size, ``V``
vocabulary, ``D`` width.

**One layout at a time.** A layer stores its weights as rows (``qweight``, ``scales``,
``mins``: the layout saved, written to GGUF and loaded). The first time the ``q8tile``
kernel runs it (int8 activations on an AVX-512 VNNI build), the rows are interleaved into
tiles of 16 output features (:func:`attnlab.backends.qmatmul_cpu.tile_weights`) and the
rows are dropped: from then on ``qweight``/``scales``/``mins``, ``state_dict()``,
``dequantize()`` and the embedding lookup read the tiles back exactly
(:func:`~attnlab.backends.qmatmul_cpu.untile_levels`), and a kernel that reads rows
(forced by name) builds its own form on demand. Loading a state dict, ``set_weights`` or
a cast (``.to(dtype)``) brings the rows back first.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnlab.backends.qmatmul import (
    COMPUTE_POLICIES,
    KERNELS,
    LinearChoice,
    choose_kernel,
    run_kernel,
)
from attnlab.functional._checks import check_positive_int
from attnlab.functional.quant import (
    check_group_size,
    dequantize_int4,
    dequantize_int8,
    pack_nibbles,
    quantize_int4,
    quantize_int8,
    unpack_nibbles,
)

__all__ = ["Int4Linear", "Int8Linear", "QuantEmbedding", "QuantLinear"]

_ROWS = ("qweight", "scales", "mins")


class QuantLinear(nn.Module):
    """What the int8 and int4 layers share: shape, bias, kernel choice, forward.

    Args:
        in_features: ``K``.
        out_features: ``N``.
        group_size: ``G``.
        bias: a float bias ``[N]`` (a parameter).
        kernel: ``"auto"`` or a name in :data:`attnlab.backends.qmatmul.KERNELS`.
        compute: the compute-dtype policy (``"auto"``: bfloat16 on CPUs with native
            bfloat16 matmul, else the activations' dtype).
    """

    kind = ""

    def __init__(
        self,
        *,
        in_features: int,
        out_features: int,
        group_size: int,
        bias: bool = False,
        kernel: str = "auto",
        compute: str = "auto",
    ) -> None:
        super().__init__()
        check_positive_int("in_features", in_features)
        check_positive_int("out_features", out_features)
        if kernel != "auto" and kernel not in KERNELS:
            raise ValueError(f"kernel must be 'auto' or one of {list(KERNELS)}, got {kernel!r}")
        if compute not in COMPUTE_POLICIES:
            raise ValueError(f"compute must be one of {list(COMPUTE_POLICIES)}, got {compute!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        self.kernel = kernel
        self.compute = compute
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.last_choice: LinearChoice | None = None
        self._forms: dict[tuple[str, torch.dtype], tuple[Tensor, ...]] = {}
        # the tiled layout (levels, scales, mins) once q8tile ran, and the rows' scale dtype
        self._tiled: tuple[Tensor, Tensor, Tensor | None] | None = None
        self._row_dtype = torch.float32

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, bias={self.bias is not None}, kernel={self.kernel!r}"
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:  # pragma: no cover
        raise NotImplementedError

    # ------------------------------------------------------------------ layouts

    @property
    def layout(self) -> str:
        """``"tiled"`` (q8tile's interleave, the rows dropped) or ``"rows"``."""
        return "rows" if self._tiled is None else "tiled"

    def row_tensor(self, name: str, ids: Tensor | None = None) -> Tensor:
        """Row tensor ``name`` (``"qweight"``, ``"scales"``, ``"mins"``; rows ``ids`` only
        when given), stored or read back off the tiles."""
        if self._tiled is None:
            t = self._buffers.get(name)
            if t is None:
                raise AttributeError(f"{type(self).__name__} has no {name!r}")
            return t if ids is None else t[ids]
        from attnlab.backends.qmatmul_cpu import unpack_int4, untile_levels, untile_scales

        lv, st, mt = self._tiled
        n, g = self.out_features, self.group_size
        if name == "scales":
            return untile_scales(st, n, g, self._row_dtype, ids)
        if name == "mins" and mt is not None:
            return untile_scales(mt, n, g, self._row_dtype, ids)
        if name != "qweight":
            raise AttributeError(f"{type(self).__name__} has no {name!r}")
        q = untile_levels(lv, n, ids)  # int8 [R, K], or 4-bit GGUF-order bytes [R, K/2]
        return q if self.kind == "int8" else pack_nibbles(unpack_int4(q))

    @property
    def qweight(self) -> Tensor:
        """The levels as rows: int8 ``[N, K]``, or 4-bit ``[N, K/2]`` (even column low)."""
        return self.row_tensor("qweight")

    @property
    def scales(self) -> Tensor:
        """Scales ``[N, K/G]``."""
        return self.row_tensor("scales")

    @property
    def mins(self) -> Tensor:
        """Minimums ``[N, K/G]`` (4-bit layers)."""
        return self.row_tensor("mins")

    @property
    def tiles(self) -> tuple[Tensor, Tensor, Tensor | None] | None:
        """The tiled layout ``(levels, scales, mins)`` of
        :func:`~attnlab.backends.qmatmul_cpu.tile_weights`, or None (rows)."""
        return self._tiled

    def set_tiles(
        self, tiled: tuple[Tensor, Tensor, Tensor | None], row_dtype: torch.dtype | None = None
    ) -> None:
        """Make ``tiled`` the one layout kept (rows read back in ``row_dtype``, default the
        rows' own): the rows and the row kernels' forms go."""
        self._row_dtype = row_dtype or self.scales.dtype
        self._tiled = tiled
        for name in _ROWS:
            self._buffers.pop(name, None)
        self._forms.clear()

    def _ensure_rows(self) -> None:
        """Bring the rows back (exactly) and drop the tiles."""
        if self._tiled is None:
            return
        rows = {
            name: self.row_tensor(name) for name in _ROWS if name != "mins" or self.kind == "int4"
        }
        self._tiled = None
        self._buffers.update(rows)
        self._forms.clear()

    def kernel_form(self, name: str, dtype: torch.dtype) -> tuple[Tensor, ...]:
        """The weights as kernel ``name`` reads them in ``dtype``, built once and kept
        (``"tiled"`` becomes the layer's one layout: see the module's docstring)."""
        if name == "tiled":
            if self._tiled is None:
                from attnlab.backends.qmatmul_cpu import tile_weights

                q, scales, mins = self._tile_source()
                self.set_tiles(tile_weights(q, scales, mins, self.group_size))
            assert self._tiled is not None
            return tuple(t for t in self._tiled if t is not None)
        key = (name, dtype)
        form = self._forms.get(key)
        if form is None or form[0].device != self._device():
            form = self._build_form(name, dtype)
            self._forms[key] = form
        return form

    def _device(self) -> torch.device:
        return (self.scales if self._tiled is None else self._tiled[1]).device

    def _build_form(self, name: str, dtype: torch.dtype) -> tuple[Tensor, ...]:  # pragma: no cover
        raise NotImplementedError

    def _tile_source(self) -> tuple[Tensor, Tensor, Tensor | None]:  # pragma: no cover
        """The row kernels' levels, scales and mins, which :func:`tile_weights` interleaves."""
        raise NotImplementedError

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._tiled is not None:  # the saved layout is always the rows
            for name in _ROWS:
                if name != "mins" or self.kind == "int4":
                    destination[prefix + name] = self.row_tensor(name)

    def _load_from_state_dict(self, *args: object, **kwargs: object) -> None:
        self._ensure_rows()
        self._forms.clear()  # new weights: the packed forms are rebuilt on first use
        super()._load_from_state_dict(*args, **kwargs)  # type: ignore[arg-type]

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        if self._tiled is not None:
            probe = torch.empty(0, dtype=self._row_dtype, device=self._tiled[1].device)
            moved = fn(probe)  # what fn would make of the rows' scales
            if moved.dtype != probe.dtype or moved.device != probe.device:
                self._ensure_rows()  # a cast or a move: done on the rows, tiled again on use
        self._forms.clear()
        return super()._apply(fn, recurse)

    def forward(self, x: Tensor) -> Tensor:
        """``[..., K] -> [..., N]``."""
        rows = x.numel() // max(x.shape[-1], 1)
        choice = choose_kernel(self, rows, x.dtype, kernel=self.kernel, compute=self.compute)
        if not torch.compiler.is_compiling():
            self.last_choice = choice
        y = run_kernel(self, x, choice)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @property
    def weight_nbytes(self) -> int:
        """Bytes of the stored weights (levels, scales, minimums, in the layout kept), the
        bias left out."""
        stored = list(self.buffers(recurse=False)) + [t for t in self._tiled or () if t is not None]
        return sum(b.numel() * b.element_size() for b in stored)

    @property
    def resident_nbytes(self) -> int:
        """:attr:`weight_nbytes` plus the kernels' own forms kept beside them (a form that
        is the stored tensor itself counted once)."""
        seen = {t.data_ptr() for t in self.buffers(recurse=False)}
        extra = 0
        for form in self._forms.values():
            for t in form:
                if t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    extra += t.numel() * t.element_size()
        return self.weight_nbytes + extra


class Int8Linear(QuantLinear):
    """``y = x (scale * q)^T + b`` with int8 ``q [N, K]`` and ``scales [N, K/G]``.

    ``group_size=None`` is one scale per output channel (the ``int8pack`` kernel's layout);
    ``group_size=32`` is GGUF's Q8_0. See :class:`QuantLinear` for the other arguments.
    """

    kind = "int8"

    def __init__(
        self,
        *,
        in_features: int,
        out_features: int,
        group_size: int | None = None,
        bias: bool = False,
        kernel: str = "auto",
        compute: str = "auto",
    ) -> None:
        g = in_features if group_size is None else check_group_size(group_size, in_features, bits=8)
        super().__init__(
            in_features=in_features,
            out_features=out_features,
            group_size=g,
            bias=bias,
            kernel=kernel,
            compute=compute,
        )
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.zeros(out_features, in_features // g))

    @classmethod
    def from_float(
        cls, linear: nn.Linear, *, group_size: int | None = None, **kwargs: str
    ) -> Int8Linear:
        """Quantize an ``nn.Linear`` (round to nearest, ``scale = amax / 127`` per group)."""
        layer = cls(
            in_features=linear.in_features,
            out_features=linear.out_features,
            group_size=group_size,
            bias=linear.bias is not None,
            **kwargs,
        )
        q, scales = quantize_int8(linear.weight, group_size)
        layer.set_weights(q, scales)
        if linear.bias is not None:
            assert layer.bias is not None
            layer.bias.data.copy_(linear.bias.detach())
        return layer

    def set_weights(self, q: Tensor, scales: Tensor) -> None:
        """Store int8 ``q [N, K]`` and ``scales [N, K/G]`` (copied, scales as float32)."""
        want = (
            (self.out_features, self.in_features),
            (self.out_features, self.in_features // self.group_size),
        )
        if tuple(q.shape) != want[0] or q.dtype != torch.int8 or tuple(scales.shape) != want[1]:
            raise ValueError(
                f"int8 weights must be int8 {want[0]} with scales {want[1]}, got {q.dtype} "
                f"{tuple(q.shape)} and {tuple(scales.shape)}"
            )
        self._ensure_rows()
        self.qweight.copy_(q)
        self.scales.copy_(scales.to(torch.float32))
        self._forms.clear()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``scale * q`` as ``[N, K]``."""
        return dequantize_int8(self.qweight, self.scales, dtype)

    def _build_form(self, name: str, dtype: torch.dtype) -> tuple[Tensor, ...]:
        if name == "int8pack":
            return self.qweight.contiguous(), self.scales[:, 0].to(dtype).contiguous()
        if name == "fused":
            return self.qweight.contiguous(), self.scales.contiguous()
        assert name == "int8groups"
        g = self.group_size
        out: list[Tensor] = []
        for i in range(self.in_features // g):
            # contiguous scales: torch's kernel reads a strided column as if it were dense
            q_i = self.qweight[:, i * g : (i + 1) * g].contiguous()
            out += [q_i, self.scales[:, i].to(dtype).contiguous()]
        return tuple(out)

    def _tile_source(self) -> tuple[Tensor, Tensor, Tensor | None]:
        return self.qweight, self.scales, None


class Int4Linear(QuantLinear):
    """``y = x (scale * q + min)^T + b`` with 4-bit levels ``q`` in groups of ``G``.

    Stores ``qweight`` uint8 ``[N, K/2]`` (two levels a byte, the even column low),
    ``scales`` and ``mins`` float32 ``[N, K/G]``: GGUF's Q4_1 with ``G = 32`` (Q4_0 has
    ``min = -8 scale``). See :class:`QuantLinear` for the other arguments.
    """

    kind = "int4"

    def __init__(
        self,
        *,
        in_features: int,
        out_features: int,
        group_size: int = 32,
        bias: bool = False,
        kernel: str = "auto",
        compute: str = "auto",
    ) -> None:
        check_group_size(group_size, in_features, bits=4)
        super().__init__(
            in_features=in_features,
            out_features=out_features,
            group_size=group_size,
            bias=bias,
            kernel=kernel,
            compute=compute,
        )
        n, groups = out_features, in_features // group_size
        self.register_buffer("qweight", torch.zeros(n, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.zeros(n, groups))
        self.register_buffer("mins", torch.zeros(n, groups))

    @classmethod
    def from_float(cls, linear: nn.Linear, *, group_size: int = 32, **kwargs: str) -> Int4Linear:
        """Quantize an ``nn.Linear`` (min/max per group, round to nearest: llama.cpp's Q4_1)."""
        layer = cls(
            in_features=linear.in_features,
            out_features=linear.out_features,
            group_size=group_size,
            bias=linear.bias is not None,
            **kwargs,
        )
        levels, scales, mins = quantize_int4(linear.weight, group_size)
        layer.set_weights(levels, scales, mins)
        if linear.bias is not None:
            assert layer.bias is not None
            layer.bias.data.copy_(linear.bias.detach())
        return layer

    def set_weights(self, levels: Tensor, scales: Tensor, mins: Tensor) -> None:
        """Store levels ``[N, K]`` in ``0..15`` (any integer dtype) with ``scales``/``mins``
        ``[N, K/G]`` (as float32)."""
        n, k, g = self.out_features, self.in_features, self.in_features // self.group_size
        ok = (
            tuple(levels.shape) == (n, k)
            and not levels.is_floating_point()
            and tuple(scales.shape) == (n, g)
            and tuple(mins.shape) == (n, g)
        )
        if not ok:
            raise ValueError(
                f"int4 weights must be integer levels {(n, k)} with scales and mins {(n, g)}, "
                f"got {levels.dtype} {tuple(levels.shape)}, {tuple(scales.shape)}, {tuple(mins.shape)}"
            )
        if levels.numel() and (int(levels.min()) < 0 or int(levels.max()) > 15):
            raise ValueError(
                f"int4 levels must lie in 0..15, got {int(levels.min())}..{int(levels.max())}"
            )
        self._ensure_rows()
        self.qweight.copy_(pack_nibbles(levels))
        self.scales.copy_(scales.to(torch.float32))
        self.mins.copy_(mins.to(torch.float32))
        self._forms.clear()

    def levels(self) -> Tensor:
        """The stored levels, ``[N, K]`` uint8 in ``0..15``."""
        if self._tiled is not None:
            from attnlab.backends.qmatmul_cpu import unpack_int4, untile_levels

            return unpack_int4(untile_levels(self._tiled[0], self.out_features))
        return unpack_nibbles(self.qweight)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``scale * q + min`` as ``[N, K]``."""
        return dequantize_int4(self.levels(), self.scales, self.mins, dtype)

    def _build_form(self, name: str, dtype: torch.dtype) -> tuple[Tensor, ...]:
        if name == "fused":
            from attnlab.backends.qmatmul_cpu import repack_int4

            return repack_int4(self.levels()), self.scales.contiguous(), self.mins.contiguous()
        assert name == "int4pack"
        packed = torch._convert_weight_to_int4pack_for_cpu(self.levels().to(torch.int32), 2)
        # the kernel computes (q - 8) * scale + zero: zero = min + 8 * scale
        zeros = self.mins + 8.0 * self.scales
        sz = torch.stack([self.scales, zeros], dim=-1).transpose(0, 1)  # [K/G, N, 2]
        return packed, sz.to(dtype).contiguous()

    def _tile_source(self) -> tuple[Tensor, Tensor, Tensor | None]:
        from attnlab.backends.qmatmul_cpu import repack_int4

        return repack_int4(self.levels()), self.scales, self.mins


class QuantEmbedding(nn.Module):
    """An embedding table stored as a quantized ``[V, D]`` layer: rows are looked up and
    expanded, and the same table multiplies as a tied LM head (:meth:`logits`).

    Args:
        table: an :class:`Int8Linear` or :class:`Int4Linear` with ``out_features = V``.
    """

    def __init__(self, *, table: QuantLinear) -> None:
        super().__init__()
        if not isinstance(table, QuantLinear):
            raise TypeError(
                f"table must be an Int8Linear or Int4Linear, got {type(table).__name__}"
            )
        self.table = table
        self.num_embeddings = table.out_features
        self.embedding_dim = table.in_features

    @classmethod
    def from_float(
        cls, embedding: nn.Embedding, *, kind: str, group_size: int | None, **kwargs: str
    ) -> QuantEmbedding:
        """Quantize an ``nn.Embedding`` row by row (as a ``[V, D]`` weight)."""
        lin = nn.Linear(embedding.embedding_dim, embedding.num_embeddings, bias=False)
        lin.weight = embedding.weight
        if kind == "int8":
            return cls(table=Int8Linear.from_float(lin, group_size=group_size, **kwargs))
        return cls(table=Int4Linear.from_float(lin, group_size=group_size or 32, **kwargs))

    @property
    def weight(self) -> Tensor:
        """The table in float32, ``[V, D]`` (expanded on each access)."""
        return self.table.dequantize(torch.float32)

    def forward(self, ids: Tensor) -> Tensor:
        """``[...]`` token ids -> ``[..., D]`` rows in the scales' dtype (float32 unless
        the model was cast)."""
        t = self.table
        flat = ids.reshape(-1)
        scales = t.row_tensor("scales", flat)  # [n, D/G]
        if isinstance(t, Int8Linear):
            rows = dequantize_int8(t.row_tensor("qweight", flat), scales, scales.dtype)
        else:
            assert isinstance(t, Int4Linear)
            levels = unpack_nibbles(t.row_tensor("qweight", flat))
            rows = dequantize_int4(levels, scales, t.row_tensor("mins", flat), scales.dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)

    def logits(self, x: Tensor) -> Tensor:
        """``[..., D] -> [..., V]``: the table as a tied output layer."""
        return self.table(x)
