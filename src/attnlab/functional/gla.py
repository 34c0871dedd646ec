"""Gated linear attention (GLA): recurrent, one-step and chunked forms.

Yang et al. (2024), "Gated linear attention transformers with hardware-efficient
training", eq. 3 and section 4 (the chunkwise form with secondary chunks). Per head, with
a data-dependent decay per key dimension ``alpha_t = exp(gk_t)``:

    S_t = diag(alpha_t) S_{t-1} + k_t v_t^T,        o_t = S_t^T (scale q_t)

Chunked: inside a chunk, with ``b_i`` the log decay accumulated from the chunk's start to
token ``i`` (per key dimension), the output is
``o_i = (q_i e^{b_i})^T S_0 + sum_{j<=i} (sum_d q_id k_jd e^{b_id - b_jd}) v_j``. Every
exponent is kept ``<= 0``: the score between sub-chunks ``J < I`` factorises through the
last token before sub-chunk ``I`` (both factors are decays of at most 1), and the
diagonal sub-chunks are computed exactly, element by element. So the form is exact for
any decay, with no ``e^{+b}`` that could overflow.

Shape notation: ``B`` batch, ``H`` heads, ``L`` tokens, ``K`` key dim, ``V`` value dim,
``T`` chunk size, ``C`` sub-chunk size (16, or ``T`` when it does not divide ``T``).

Padding: where ``mask`` is 0 the token is skipped (no decay, no input).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.functional._scan_checks import check_chunk_size, check_float, check_shape, token_mask

__all__ = ["gla_chunked", "gla_reference", "gla_step"]

SUB_CHUNK = 16


def _check(
    q: Tensor, k: Tensor, v: Tensor, gk: Tensor, state: Tensor | None
) -> tuple[int, int, int, int, int]:
    check_float("q", q)
    if q.dim() != 4:
        raise ValueError(f"q must be (batch, heads, seq_len, key_dim), got {tuple(q.shape)}")
    b, h, l, dk = q.shape
    check_shape("k", k, (b, h, l, dk), "(batch, heads, seq_len, key_dim) as q")
    check_shape("gk", gk, (b, h, l, dk), "(batch, heads, seq_len, key_dim) as q")
    check_float("v", v)
    if v.dim() != 4 or v.shape[:3] != (b, h, l):
        raise ValueError(
            f"v must be (batch={b}, heads={h}, seq_len={l}, value_dim), got {tuple(v.shape)}"
        )
    dv = v.shape[-1]
    if state is not None:
        check_shape("state", state, (b, h, dk, dv), "(batch, heads, key_dim, value_dim)")
    return b, h, l, dk, dv


def _scale(scale: float | None, dk: int) -> float:
    if scale is None:
        return dk**-0.5
    if not isinstance(scale, int | float) or isinstance(scale, bool) or scale <= 0:
        raise ValueError(
            f"scale must be a positive number or None (1/sqrt(key_dim)), got {scale!r}"
        )
    return float(scale)


def _masked(k: Tensor, gk: Tensor, mask: Tensor | None, b: int, l: int) -> tuple[Tensor, Tensor]:
    m = token_mask(mask, b, l, k)
    if m is None:
        return k, gk
    m = m[:, None, :, None]
    return k * m, gk * m


def gla_step(
    q: Tensor, k: Tensor, v: Tensor, gk: Tensor, state: Tensor, *, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """One token of GLA: the decoding step.

    Args:
        q, k: ``[B, H, K]``; v: ``[B, H, V]``; gk: ``[B, H, K]`` log decays ``<= 0``.
        state: ``[B, H, K, V]`` before the token.
        scale: query scale (default ``1/sqrt(K)``).

    Returns:
        ``(o [B, H, V], state after the token [B, H, K, V])``.
    """
    s = gk.exp()[..., None] * state + k[..., :, None] * v[..., None, :]
    o = torch.einsum("bhk,bhkv->bhv", q * _scale(scale, q.shape[-1]), s)
    return o, s


def gla_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gk: Tensor,
    *,
    scale: float | None = None,
    state: Tensor | None = None,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """GLA one token at a time (the recurrent form; the reference).

    Args:
        q: ``[B, H, L, K]`` queries.
        k: ``[B, H, L, K]`` keys.
        v: ``[B, H, L, V]`` values.
        gk: ``[B, H, L, K]`` log decays ``<= 0`` per key dimension (GLA: ``logsigmoid(.)/16``).
        scale: query scale (default ``1/sqrt(K)``).
        state: ``[B, H, K, V]`` state before the first token (default zeros).
        mask: ``[B, L]`` 1 = token, 0 = padding (skipped).

    Returns:
        ``(o [B, H, L, V], state after the last token [B, H, K, V])``.

    Raises:
        ValueError: shapes that do not fit (named), a non-positive scale.
        TypeError: a non-floating tensor.
    """
    b, h, l, dk, dv = _check(q, k, v, gk, state)
    k, gk = _masked(k, gk, mask, b, l)
    s = state if state is not None else q.new_zeros((b, h, dk, dv))
    out = []
    for t in range(l):
        o_t, s = gla_step(q[:, :, t], k[:, :, t], v[:, :, t], gk[:, :, t], s, scale=scale)
        out.append(o_t)
    o = torch.stack(out, dim=2) if out else q.new_zeros((b, h, 0, dv))
    return o, s


def intra_chunk_scores(
    qc: Tensor, kc: Tensor, b_row: Tensor, b_col: Tensor | None = None, *, strict: bool = False
) -> Tensor:
    """``A [.., T, T]``: ``sum_d q_id k_jd e^{b_row_id - b_col_jd}`` for ``j <= i`` (``j < i``
    when ``strict``), 0 elsewhere.

    ``qc, kc, b_row, b_col [B, H, nc, T, K]``: log decays from the chunk's start, with
    ``b_row_i <= b_col_j`` wherever the score is kept (GLA: ``b_row = b_col``, inclusive;
    the generalized delta rule also reads the decay up to the token before). Shared with
    :mod:`attnlab.functional.rwkv7`.
    """
    b_col = b_row if b_col is None else b_col
    *lead, T, dk = qc.shape
    C = SUB_CHUNK if T % SUB_CHUNK == 0 else T
    n = T // C
    qs, ks, rs, cs = (x.reshape(*lead, n, C, dk) for x in (qc, kc, b_row, b_col))
    # diagonal sub-chunks, exact: e^{b_i - b_j} per dimension
    drop = torch.ones(C, C, dtype=torch.bool, device=qc.device).triu(0 if strict else 1)
    diff = (rs[..., :, None, :] - cs[..., None, :, :]).masked_fill(drop[..., None], float("-inf"))
    diag = (qs[..., :, None, :] * diff.exp() * ks[..., None, :, :]).sum(-1)  # [.., n, C, C]
    eye = torch.eye(n, dtype=qc.dtype, device=qc.device)[:, None, :, None]
    scores = (diag[..., :, :, None, :] * eye).reshape(*lead, n, C, T)  # row block I, all columns
    if n > 1:
        # sub-chunks J < I through r_I, the column decay at the last token before sub-chunk I
        ref = torch.cat((torch.zeros_like(cs[..., :1, -1, :]), cs[..., :-1, -1, :]), dim=-2)
        q_til = qs * (rs - ref[..., None, :]).clamp(max=0).exp()  # [.., n, C, K], exponents <= 0
        # exponents r_I - b_j <= 0 for j before sub-chunk I; clamped where masked below
        k_til = (
            kc[..., None, :, :] * (ref[..., None, :] - b_col[..., None, :, :]).clamp(max=0).exp()
        )
        off = torch.einsum("...nik,...njk->...nij", q_til, k_til)  # [.., n, C, T]
        col_block = torch.arange(T, device=qc.device) // C
        before = col_block[None, :] < torch.arange(n, device=qc.device)[:, None]  # [n, T]
        scores = scores + off * before[:, None, :]
    return scores.reshape(*lead, T, T)


def gla_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gk: Tensor,
    *,
    scale: float | None = None,
    state: Tensor | None = None,
    mask: Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """GLA in chunks of ``chunk_size`` tokens (the chunkwise form with secondary chunks).

    Arguments and returns as :func:`gla_reference`, plus ``chunk_size`` (``T``). Memory is
    ``O(L T + L C K)``; the inter-chunk recurrence runs ``L / T`` steps.
    """
    T = check_chunk_size(chunk_size)
    b, h, l, dk, dv = _check(q, k, v, gk, state)
    k, gk = _masked(k, gk, mask, b, l)
    q = q * _scale(scale, dk)
    nc = max(1, -(-l // T))
    pad = nc * T - l
    if pad:  # padded tail: zero keys and no decay
        q, k, v, gk = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, gk))
    qc = q.reshape(b, h, nc, T, dk)
    kc = k.reshape(b, h, nc, T, dk)
    vc = v.reshape(b, h, nc, T, dv)
    bc = gk.reshape(b, h, nc, T, dk).cumsum(-2)  # log decay from the chunk's start
    inner = intra_chunk_scores(qc, kc, bc) @ vc  # [B, H, nc, T, V]
    q_dec = qc * bc.exp()  # reads S_0 decayed to each token
    k_dec = kc * (bc[..., -1:, :] - bc).exp()  # writes decayed to the chunk's end
    chunk_decay = bc[..., -1, :].exp()[..., None]  # [B, H, nc, K, 1]
    writes = k_dec.transpose(-1, -2) @ vc  # [B, H, nc, K, V]
    s = state if state is not None else q.new_zeros((b, h, dk, dv))
    starts = []
    for dc, wr in zip(chunk_decay.unbind(2), writes.unbind(2)):  # unbound once: no
        starts.append(s)  # full-size zero gradient per chunk in backward
        s = dc * s + wr
    cross = q_dec @ torch.stack(starts, dim=2)  # [B, H, nc, T, V]
    o = (inner + cross).reshape(b, h, nc * T, dv)[:, :, :l]
    return o, s
