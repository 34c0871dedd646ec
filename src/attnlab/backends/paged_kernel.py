"""The ``paged_kernel`` backend: attention that reads a paged KV pool in place (C++, CPU).

PagedAttention (Kwon et al., 2023, "Efficient memory management for large language model
serving with PagedAttention", section 4.1) keeps each sequence's keys/values in blocks
of one pool per layer and reads them through the sequence's block table. The ``paged``
backend (:mod:`attnlab.backends.paged`) and the gather path copy the blocks out into a
batch first, which on a CPU costs more than the attention itself (a 32-stream decode
step of the serving benchmark spent 36% of its time in that copy). This backend hands
the pool, the block tables and the queries to a small C++ kernel
(``csrc/paged_attention.cpp``, built and cached by :mod:`attnlab.backends.native`) that
walks each row's keys in place, 32 at a time, with an online softmax (Dao et al., 2022),
parallel over (row, tile of 16 queries) on torch's intra-op threads: the keys are read
once, nothing is copied and no score matrix is built. All query heads of a key/value
head (GQA's group) and all queries of the tile share each key it loads: a tile's scores
are a small register-blocked GEMM (or, for a decode step's few rows, one dot product per
key and row), the softmax runs across the rows in SIMD lanes with a polynomial ``exp``
(about 1 ulp) and one rescale per 32 keys, and the values are added as another small
GEMM. The same code is built for AVX-512, AVX2+FMA and scalar floats, whichever
``-march`` allows, and the widest runs (``tests/backends/test_paged_kernel_simd.py``
checks each against float64).

What it runs: float32 on the CPU, inference (no gradient, dropout or weights), the
causal pattern or a causal sliding window (``causal()``, ``sliding_window(w)``, or both
combined) without score modifiers, grouped-query heads. Anything else (ALiBi, soft
caps, other patterns, float16/bfloat16, a pool holding int8/int4 levels) its check
refuses with the reason, and ``auto`` ranks the other backends (the ``paged`` block
copy and the gather path stay selectable by name). It is exact: the same softmax over
the same keys, up to float rounding (the kernel sums in another order).

Shape notation: ``B`` rows, ``H`` query heads, ``H_kv`` key/value heads, ``L`` query
positions, ``E``/``Ev`` key/value head dims, ``N`` blocks, ``bs`` block size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.backend_traits import TRAITS
from attnlab.backends import native
from attnlab.backends.call import AttentionCall, Backend
from attnlab.backends.cost_model import Estimate, computed_pairs, format_seconds, units
from attnlab.backends.plan import BlockTable
from attnlab.backends.registry import register
from attnlab.functional.masks import MaskPattern

__all__ = ["paged_kernel_attention", "pattern_window"]

#: The kernel's constants, one thread, float32, head dim 64 (``KERNEL_*``), fitted to
#: ``benchmarks/paged_kernel.py`` under the bench lock (docs/benchmarks.md "Paged attention
#: kernel"), scaled to a quiet machine as the other backends' constants are. A decode step
#: is bound by the bytes it reads: 32 rows x 160 keys of SmolLM2 (7.9 MB of keys/values)
#: 0.9-1.2 ms, 32 x 1024 (50 MB) 8.9-12 ms. A prefill chunk is bound by its small GEMMs:
#: 3.3e-9 s per work unit of the (16-query x 32-key) tiles it computes, plus 19 us per
#: (row, 16-query tile) task (the queries' transposition, the diagonal tiles' masks):
#: 8 rows x 128 queries x 128 keys 4.1 ms (the block copy + torch's flash kernel 7.1 ms),
#: 8 x 128 after 384 cached 16.9 ms (23.4), 1 x 512 x 512 5.2 ms (10.6).
KERNEL_BYTES_PER_S = 7e9
KERNEL_SECONDS_PER_UNIT = 3.3e-9  # one (query, key) pair of one head at head dim 64
KERNEL_TASK_S = 1.9e-5  # per (row, tile of 16 queries) whose rows make a GEMM
KERNEL_OVERHEAD_S = 2e-5  # the dispatcher and the rows' metadata, per call
KERNEL_QUERY_TILE, KERNEL_KEY_TILE = 16, 32  # csrc/paged_attention.cpp's tiles
KERNEL_DOT_ROWS = 8  # at most this many query rows per key head: dot products, no GEMM


def pattern_window(pattern: MaskPattern | None, is_causal: bool) -> int | str | None:
    """The kernel's form of a pattern: ``-1`` (causal), ``w`` (a causal window: keys at
    ``t - w .. t``), or a string saying why the kernel cannot run it."""
    if pattern is not None and pattern.score_mods:
        return "no score modifiers (ALiBi, soft-capping)"
    key = pattern.structure() if pattern is not None else None
    parts = [key] if key is None or key[0] != "&" else list(key[1:])
    causal, window = is_causal, None
    for part in parts:
        if part is None:
            continue
        if not isinstance(part, tuple) or part[1] is not None:
            return f"only causal and sliding-window patterns, got {pattern!r}"
        if part[0] == "Causal" and len(part) == 2:
            causal = True
        elif part[0] == "SlidingWindow" and len(part) == 4 and part[3] >= 0:
            left = int(part[2])  # type: ignore[call-overload]
            window = left if window is None else min(window, left)
            causal = True  # the kernel never reads keys past the query: right is clipped
        else:
            return f"only causal and sliding-window patterns, got {pattern!r}"
    if not causal:
        return "only causal patterns (a query reads no key after it)"
    return -1 if window is None else window


def _meta(table: BlockTable) -> Tensor:
    """``[B, 3]`` long (length, offset, first block) of the rows, made once per table."""
    meta: Tensor | None = table.__dict__.get("_kernel_meta")
    if meta is None:
        rows = list(zip(table.lengths, table.offsets, table.first_block))
        meta = torch.tensor(rows, dtype=torch.long).view(-1, 3)
        table.__dict__["_kernel_meta"] = meta  # a frozen record: its derived index, kept
    return meta


def paged_kernel_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: MaskPattern | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    return_weights: bool = False,
    q_positions: Tensor | None = None,
    k_positions: Tensor | None = None,
    block_table: BlockTable | None = None,
) -> tuple[Tensor, None]:
    """Attend from ``query [B, H, L, E]`` to the keys ``block_table`` points at, in place.

    Args:
        query: ``[B, H, L, E]`` float32.
        key: the layer's key pool ``[N * bs, H_kv, E]``, contiguous.
        value: the layer's value pool ``[N * bs, H_kv, Ev]``, contiguous.
        attn_mask: ``causal()``, ``sliding_window(w)`` or both, or None (with
            ``is_causal``), evaluated on the keys' slots (``offsets[b] + p``).
        dropout_p: must be 0 (checked by the registry).
        is_causal: a causal pattern.
        scale: score scale (default ``1/sqrt(E)``).
        enable_gqa: ``H`` a multiple of ``H_kv``.
        return_weights: must be False (checked by the registry).
        q_positions: long ``[B|1, L]`` slots of the queries (default ``T - L .. T - 1``).
        k_positions: ignored: the keys' slots come from the block table.
        block_table: the rows' block tables (required).

    Returns:
        ``(output [B, H, L, Ev], None)``; a query that sees no key gets zeros.

    Raises:
        ValueError: no ``block_table``, pools that are not contiguous ``[slots, H_kv, E]``,
            a table that points past the pools or holds fewer blocks than its rows' lengths,
            or a pattern the kernel does not run.
        TypeError: tensors other than float32.
        RuntimeError: the kernel is unavailable on this machine (the reason).
    """
    del dropout_p, return_weights, k_positions, enable_gqa
    if block_table is None:
        raise ValueError("the paged_kernel backend reads keys through a block table")
    if key.dim() != 3 or value.dim() != 3:
        raise ValueError(
            "the paged_kernel backend takes the layer's pools [slots, kv_heads, head_dim], "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    window = pattern_window(attn_mask, is_causal)
    if isinstance(window, str):
        raise ValueError(f"the paged_kernel backend runs {window}")
    compiling = torch.compiler.is_compiling()
    if not compiling:  # a compiled bucket's tables come from the runner (checked there)
        _check_inputs(query, key, value, block_table)
    b, _, L, e = query.shape
    if q_positions is None:
        total = block_table.offsets[0] + block_table.lengths[0]  # T, the same for every row
        q_positions = torch.arange(total - L, total, device=query.device)[None]
    q_pos = q_positions.expand(b, L)
    s = 1.0 / e**0.5 if scale is None else float(scale)
    meta = block_table.meta if block_table.meta is not None else _meta(block_table)
    assert isinstance(window, int)
    run = _paged_op if compiling else _paged_run  # an opaque op in a graph (a fake kernel)
    return run(
        query, key, value, block_table.table, q_pos, meta, s, window, block_table.block_size
    ), None


def _paged_run(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    table: Tensor,
    q_pos: Tensor,
    meta: Tensor,
    scale: float,
    window: int,
    block_size: int,
) -> Tensor:
    b, h, L, _ = query.shape
    out = query.new_empty(b, h, L, value.shape[-1])
    kernel = native.load_paged()
    kernel(query, key, value, table, q_pos, meta, scale, window, block_size, out)  # type: ignore[operator]
    return out


@torch.library.custom_op("attnlab::paged_attention", mutates_args=())
def _paged_op(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    table: Tensor,
    q_pos: Tensor,
    meta: Tensor,
    scale: float,
    window: int,
    block_size: int,
) -> Tensor:
    """The kernel as a torch custom op (``attnlab::paged_attention``): a compiled decode
    bucket calls it without a graph break (``csrc/paged_attention.cpp`` writes into an
    output argument, which a graph cannot trace)."""
    return _paged_run(query, key, value, table, q_pos, meta, scale, window, block_size)


@_paged_op.register_fake
def _(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    table: Tensor,
    q_pos: Tensor,
    meta: Tensor,
    scale: float,
    window: int,
    block_size: int,
) -> Tensor:
    b, h, L, _ = query.shape
    return query.new_empty(b, h, L, value.shape[-1])


def _check_inputs(query: Tensor, key: Tensor, value: Tensor, table: BlockTable) -> None:
    """What the kernel would otherwise read out of bounds or misread, refused by name."""
    dtypes = {query.dtype, key.dtype, value.dtype}
    if dtypes != {torch.float32}:
        raise TypeError(f"the paged_kernel backend runs float32, got {sorted(map(str, dtypes))}")
    if not (key.is_contiguous() and value.is_contiguous()):
        raise ValueError("the paged_kernel backend reads contiguous pools [slots, kv_heads, dim]")
    if query.shape[0] != table.table.shape[0] or query.shape[1] % key.shape[1]:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit {table.table.shape[0]} block-table rows "
            f"over {key.shape[1]} key/value heads"
        )
    bs, width = table.block_size, table.table.shape[1]
    held = key.shape[0] // bs
    longest = max(table.lengths)
    top: int | None = table.__dict__.get("_kernel_max")
    if top is None:  # once per table: every layer of the step shares it
        top = int(table.table.max()) if table.table.numel() else -1
        table.__dict__["_kernel_max"] = top
    if longest > width * bs or top >= held:
        raise ValueError(
            f"block_table holds rows of up to {longest} tokens in {width} blocks of {bs}, "
            f"with block ids up to {top}; the pools hold {held} blocks"
        )
    if min(table.offsets) < 0 or min(table.first_block) < 0:
        raise ValueError(f"block_table offsets/first_block must be >= 0, got {table}")


def _check(call: AttentionCall) -> str | None:
    if call.block_size <= 0:
        return "reads keys through a paged cache's block table; the keys here are contiguous"
    if call.device.type != "cpu":
        return f"a CPU kernel, the call is on {call.device.type}"
    if call.dtype != torch.float32:
        return f"float32 only, got {call.dtype}"
    if call.needs_grad:
        return "no gradients (an inference kernel)"
    if call.dropout_p > 0:
        return "no dropout (an inference path)"
    if call.return_weights:
        return "returns no attention weights"
    if call.mask in ("bool", "float"):
        return "takes a mask pattern, not a dense mask"
    window = pattern_window(call.pattern, call.is_causal)
    if isinstance(window, str):
        return window
    reason = native.paged_status()
    if reason is not None:
        return reason
    return None


def _cost(call: AttentionCall) -> Estimate | None:
    if call.device.type != "cpu":
        return None
    b, h_kv, s, e = call.key_shape[0], call.key_shape[-3], call.key_shape[-2], call.key_shape[-1]
    L = call.query_shape[-2]
    # the keys read once from the pool, in place, or the tiles' GEMMs, whichever bounds it
    nbytes = b * h_kv * s * (e + call.value_shape[-1]) * call.dtype.itemsize
    pairs = computed_pairs(call, KERNEL_QUERY_TILE, KERNEL_KEY_TILE)
    work = units(call, pairs) * KERNEL_SECONDS_PER_UNIT
    rows = min(L, KERNEL_QUERY_TILE) * (call.query_shape[-3] // max(h_kv, 1))
    if rows > KERNEL_DOT_ROWS:  # the queries transposed per task, the diagonal masks
        work += b * -(-L // KERNEL_QUERY_TILE) * KERNEL_TASK_S
    seconds = KERNEL_OVERHEAD_S + max(nbytes / KERNEL_BYTES_PER_S, work)
    note = f"~{format_seconds(seconds)}, no copy of the keys"
    return Estimate(seconds, note)


PAGED_KERNEL = register(
    Backend(
        fn=paged_kernel_attention,
        check=_check,
        cost=_cost,
        **TRAITS["paged_kernel"].registry_fields(),
    )
)
