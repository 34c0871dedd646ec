"""Single-query attention over a contiguous KV cache: attnlab's decode kernel (C++, CPU).

A decode step attends one new query per row and head over every key written so far,
with no mask. torch's CPU flash kernel tiles that call as it tiles a prompt: measured
~110-140 us a call for SmolLM2's 9 heads over 3 key/value heads and 256 keys (0.4 MB of
keys and values, ~20 us of reading). ``csrc/decode_attention.cpp`` (built and cached by
:mod:`attnlab.backends.native`) reads each key and value once for all the query heads
of its group (grouped-query attention, Ainslie et al., 2023), with an exact softmax per
chunk of keys and the chunks merged by their maxima (FlashAttention-2's split-KV
decoding, Dao et al., 2023), on one thread for small calls and on torch's intra-op
threads over (row, head, chunk) for large ones. The ``sdpa`` backend runs it for the
calls it fits (:func:`fits`): float32 on the CPU, no gradient, no mask, no dropout, at
most 16 queries per key/value head; the same softmax over the same keys, up to float
rounding (another summation order, and a polynomial ``exp`` of about 1 ulp).

In a compiled graph it is the opaque op ``torch.ops.attnlab_dec.decode_attention``
with a fake kernel: no graph break.

Shape notation: ``B`` rows, ``H`` query heads, ``H_kv`` key/value heads, ``L`` queries,
``S`` keys, ``E``/``Ev`` key/value head dims.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from attnlab.backends import native

__all__ = ["MAX_ROWS", "decode_attention", "decode_status", "fits"]

#: The kernel's limit: queries per key/value head (``L * H / H_kv``).
MAX_ROWS = 16

_fake_registered = False
_loaded = False  # the last decode_status() answer: what a graph being traced reads


def decode_status() -> str | None:
    """None when the decode kernel is loaded (built once per machine), else why not;
    ``ATTNLAB_DECODE_KERNEL=0`` turns it off (torch's kernel runs those calls). Asked
    eagerly (a compiled ``generate`` asks before its step is traced: a graph reads the
    last answer)."""
    global _loaded
    if os.environ.get("ATTNLAB_DECODE_KERNEL") == "0":
        reason: str | None = "the decode kernel is turned off (ATTNLAB_DECODE_KERNEL=0)"
    else:
        reason = native.kernel_status("decode")
    if reason is None:
        _register_fake()
    _loaded = reason is None
    return reason


def _register_fake() -> None:
    global _fake_registered
    if _fake_registered:
        return

    @torch.library.register_fake("attnlab_dec::decode_attention")  # type: ignore[misc]
    def _(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        return q.new_empty(q.shape[0], q.shape[1], q.shape[2], v.shape[3])

    _fake_registered = True


def fits(query: Tensor, key: Tensor, value: Tensor) -> bool:
    """Whether an unmasked call ``query [B, H, L, E]`` over ``key``/``value``
    ``[B, H_kv, S, E|Ev]`` is one the kernel runs (the caller has checked: no mask,
    no dropout, not causal, no weights asked for)."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return False
    if query.device.type != "cpu" or {query.dtype, key.dtype, value.dtype} != {torch.float32}:
        return False
    b, h, L, _ = query.shape
    h_kv = key.shape[1]
    if h_kv == 0 or h % h_kv or L * (h // h_kv) > MAX_ROWS or key.shape[2] == 0:
        return False
    if key.shape[0] != b or value.shape[:3] != key.shape[:3]:
        return False
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return False
    if torch.compiler.is_compiling():
        return _loaded  # no build inside a trace: the last eager answer
    return decode_status() is None


def decode_attention(query: Tensor, key: Tensor, value: Tensor, scale: float) -> Tensor:
    """``softmax(scale * Q K^T) V`` for ``query [B, H, L, E]`` over every key of
    ``key``/``value`` ``[B, H_kv, S, E|Ev]`` (grouped heads: ``H`` a multiple of
    ``H_kv``) -> ``[B, H, L, Ev]``. The caller checks :func:`fits` first.

    Raises:
        RuntimeError: the kernel is unavailable (the reason), or shapes it does not run.
    """
    if not torch.compiler.is_compiling():
        reason = decode_status()
        if reason is not None:
            raise RuntimeError(reason)
    return torch.ops.attnlab_dec.decode_attention(query, key, value, float(scale))
