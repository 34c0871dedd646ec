"""RWKV-4's WKV recurrence: the numerically stable sequential reference and a chunked form.

Peng et al. (2023), "RWKV: reinventing RNNs for the Transformer era", eq. 14-16. Per
channel, with decay ``w = exp(time_decay) > 0`` and bonus ``u = time_first``:

    wkv_t = (sum_{s<t} e^{-(t-1-s) w + k_s} v_s + e^{u + k_t} v_t)
          / (sum_{s<t} e^{-(t-1-s) w + k_s}     + e^{u + k_t})

The stable form keeps the running sums as ``(num, den, max)`` with the real sums equal to
``num * e^max`` and ``den * e^max`` (the paper's appendix; transformers'
``rwkv_linear_attention_cpu`` uses the same state, so states convert one to one).

:func:`wkv_chunked` runs the same recurrence in two levels: every chunk of ``T`` tokens
is scanned from an empty state (``T`` steps, all chunks at once), the chunk-end states
are carried across chunks (``L/T`` steps), and each token merges its local state with
the carried one decayed by the number of tokens since the chunk start. Merging two
``(num, den, max)`` states is exact, so both forms agree to rounding.

Shape notation: ``B`` batch, ``L`` tokens, ``C`` channels, ``T`` chunk size.

Padding: where ``mask`` is 0 the state is carried unchanged (no decay, no input).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.functional._scan_checks import check_chunk_size, check_float, check_shape, token_mask

__all__ = ["EMPTY_MAX", "wkv_chunked", "wkv_empty_state", "wkv_reference"]

EMPTY_MAX = -1e38  # the ``max`` of an empty state (transformers uses the same value)

WKVState = tuple[Tensor, Tensor, Tensor]


def wkv_empty_state(b: int, c: int, *, like: Tensor) -> WKVState:
    """``(num, den, max)`` of an empty sum: zeros, zeros and ``EMPTY_MAX``, ``[B, C]`` each."""
    z = like.new_zeros((b, c))
    return z, z.clone(), torch.full_like(z, EMPTY_MAX)


def _check(
    time_decay: Tensor,
    time_first: Tensor,
    k: Tensor,
    v: Tensor,
    state: WKVState | None,
) -> tuple[int, int, int]:
    check_float("k", k)
    if k.dim() != 3:
        raise ValueError(f"k must be (batch, seq_len, channels), got {tuple(k.shape)}")
    b, l, c = k.shape
    check_shape("v", v, (b, l, c), "(batch, seq_len, channels) as k")
    check_shape("time_decay", time_decay, (c,), "(channels,)")
    check_shape("time_first", time_first, (c,), "(channels,)")
    if state is not None:
        if not isinstance(state, tuple | list) or len(state) != 3:
            raise ValueError("state must be a (num, den, max) tuple of [batch, channels] tensors")
        for name, s in zip(("state num", "state den", "state max"), state):
            check_shape(name, s, (b, c), "(batch, channels)")
    return b, l, c


def _merge(a: WKVState, b: WKVState) -> WKVState:
    """The state whose real sums are the sums of ``a``'s and ``b``'s (exact, stable)."""
    m = torch.maximum(a[2], b[2])
    ea, eb = torch.exp(a[2] - m), torch.exp(b[2] - m)
    return ea * a[0] + eb * b[0], ea * a[1] + eb * b[1], m


def _read(s: WKVState, k: Tensor, v: Tensor, u: Tensor) -> Tensor:
    """The output for key/value ``k, v`` given the state ``s`` of the tokens before."""
    m = torch.maximum(s[2], k + u)
    e1, e2 = torch.exp(s[2] - m), torch.exp(k + u - m)
    return (e1 * s[0] + e2 * v) / (e1 * s[1] + e2)


def _write(s: WKVState, k: Tensor, v: Tensor, w: Tensor) -> WKVState:
    """The state after one more token: the old sums decayed by ``e^{-w}``, plus ``e^k v``."""
    m = torch.maximum(s[2] - w, k)
    e1, e2 = torch.exp(s[2] - w - m), torch.exp(k - m)
    return e1 * s[0] + e2 * v, e1 * s[1] + e2, m


def _keep(mask_t: Tensor | None, new: WKVState, old: WKVState) -> WKVState:
    if mask_t is None:
        return new
    keep = mask_t == 0
    return (
        torch.where(keep, old[0], new[0]),
        torch.where(keep, old[1], new[1]),
        torch.where(keep, old[2], new[2]),
    )


def wkv_reference(
    time_decay: Tensor,
    time_first: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    state: WKVState | None = None,
    mask: Tensor | None = None,
) -> tuple[Tensor, WKVState]:
    """RWKV-4's WKV, one token at a time, in the stable ``(num, den, max)`` form.

    Args:
        time_decay: ``[C]``; the decay per token is ``exp(-exp(time_decay))``.
        time_first: ``[C]``, the bonus ``u`` of the current token.
        k: ``[B, L, C]`` keys.
        v: ``[B, L, C]`` values.
        state: ``(num, den, max)``, ``[B, C]`` each, the sums before the first token
            (default: empty).
        mask: ``[B, L]`` 1 = token, 0 = padding (state carried unchanged).

    Returns:
        ``(wkv [B, L, C], state after the last token)``.

    Raises:
        ValueError: shapes that do not fit (named), a malformed state.
        TypeError: a non-floating tensor.
    """
    b, l, c = _check(time_decay, time_first, k, v, state)
    m = token_mask(mask, b, l, k)
    w = torch.exp(time_decay)
    s = state if state is not None else wkv_empty_state(b, c, like=k)
    s = (s[0], s[1], s[2])
    out = []
    for t in range(l):
        out.append(_read(s, k[:, t], v[:, t], time_first))
        s = _keep(None if m is None else m[:, t, None], _write(s, k[:, t], v[:, t], w), s)
    y = torch.stack(out, dim=1) if out else k.new_zeros((b, 0, c))
    return y, s


def wkv_chunked(
    time_decay: Tensor,
    time_first: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    state: WKVState | None = None,
    mask: Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, WKVState]:
    """WKV in chunks of ``chunk_size`` tokens: equal to :func:`wkv_reference`.

    Arguments and returns as :func:`wkv_reference`, plus ``chunk_size`` (``T``).
    """
    T = check_chunk_size(chunk_size)
    b, l, c = _check(time_decay, time_first, k, v, state)
    m = token_mask(mask, b, l, k)
    if m is None:
        m = k.new_ones((b, l))
    w = torch.exp(time_decay)
    nc = max(1, -(-l // T))
    pad = nc * T - l
    kk, vv = k, v
    if pad:
        kk = F.pad(k, (0, 0, 0, pad))
        vv = F.pad(v, (0, 0, 0, pad))
        m = F.pad(m, (0, pad))
    kc = kk.view(b, nc, T, c).transpose(0, 2)  # [T, nc, B, C]
    vc = vv.view(b, nc, T, c).transpose(0, 2)
    mc = m.view(b, nc, T).transpose(0, 2)[..., None]  # [T, nc, B, 1]
    # 1. local states before each token, every chunk from an empty state
    s = wkv_empty_state(nc * b, c, like=k)
    s = (s[0].view(nc, b, c), s[1].view(nc, b, c), s[2].view(nc, b, c))
    before = []
    # unbind, not kc[t]: indexing's backward fills a zero tensor of the whole [T, ...] size
    # for every step; unbind's backward stacks the steps' gradients once
    for m_t, k_t, v_t in zip(mc.unbind(0), kc.unbind(0), vc.unbind(0)):
        before.append(s)
        s = _keep(m_t, _write(s, k_t, v_t, w), s)
    # tokens (not pads) seen before position t of its chunk, and in the whole chunk
    seen = torch.cumsum(mc, dim=0) - mc  # [T, nc, B, 1]
    total = seen[-1] + mc[-1]  # [nc, B, 1]
    # 2. carry chunk-end states across chunks
    carry = state if state is not None else wkv_empty_state(b, c, like=k)
    carry = (carry[0], carry[1], carry[2])
    starts = []
    ends = zip(total.unbind(0), s[0].unbind(0), s[1].unbind(0), s[2].unbind(0))
    for total_c, s0, s1, s2 in ends:
        starts.append(carry)
        decayed = (carry[0], carry[1], carry[2] - total_c * w)
        carry = _merge((s0, s1, s2), decayed)
    start = tuple(torch.stack([st[i] for st in starts]) for i in range(3))  # [nc, B, C] each
    # 3. every token reads its local state merged with the decayed carried state
    local = tuple(torch.stack([bt[i] for bt in before]) for i in range(3))  # [T, nc, B, C]
    full = _merge(
        (local[0], local[1], local[2]),
        (start[0].expand_as(local[0]), start[1].expand_as(local[1]), start[2] - seen * w),
    )
    y = _read(full, kc, vc, time_first)  # [T, nc, B, C]
    y = y.transpose(0, 2).reshape(b, nc * T, c)[:, :l]
    return y, carry
