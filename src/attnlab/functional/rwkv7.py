"""RWKV-7's state update (the generalized delta rule): recurrent, one-step and chunked forms.

Peng et al. (2025), "RWKV-7 'Goose' with expressive dynamic state evolution", eq. 3-5:
``wkv_t = wkv_{t-1} (diag(w_t) - kappa_t^T (a_t . kappa_t)) + v_t^T k_t``. Written on the
state ``S [K, V]`` (keys index rows, ``S = wkv^T``) with ``a = -kappa`` and
``b = kappa . a_t`` as flash-linear-attention's ``chunk_rwkv7`` takes them:

    u_t = a_t^T S_{t-1}                                      (the read before the decay)
    S_t = diag(e^{gk_t}) S_{t-1} + k_t v_t^T + b_t u_t^T,     o_t = S_t^T (scale q_t)

Chunked (from ``S_0``; ``G_i = e^{sum gk}`` per key dimension from the chunk's start to
token ``i``): the reads solve one unit lower-triangular system per chunk,
``(I - A_ab) U = (a . G_{i-1}) S_0 + A_ak V`` with
``A_xy[i, j] = sum_d x_id y_jd G_{i-1,d} / G_{j,d}`` for ``j < i``, and
``o_i = (q_i . G_i)^T S_0 + sum_{j<=i} A_qk[i, j] v_j + A_qb[i, j] u_j`` (inclusive decays).
Where every chunk decays by at most ``FACTORED_RANGE`` nats in each key dimension
(RWKV-7's ``gk >= -e^{-0.5}`` keeps a 64-token chunk within 39), the four score matrices
are one matmul per chunk: ``e^{G_i - G_j}`` factors into a row and a column part about
the chunk's mid decay, ``(x_i e^{g_i - m}) . (y_j e^{m - G_j})``, each exponent within
half the range (no overflow; the product keeps float precision, and the masked entries
are dropped with ``where``, not multiplied). Otherwise the scores come from
:func:`attnlab.functional.gla.intra_chunk_scores` (sub-chunks whose exponents are all
``<= 0``). Both give the same values.

Shape notation: ``B`` batch, ``H`` heads, ``L`` tokens, ``K`` key dim, ``V`` value dim,
``T`` chunk size. Padding: where ``mask`` is 0 the token is skipped (no decay, no write).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.functional._scan_checks import check_chunk_size, check_float, check_shape, token_mask
from attnlab.functional.gla import intra_chunk_scores

__all__ = ["rwkv7_chunked", "rwkv7_reference", "rwkv7_step"]

#: the largest decay (nats, per key dimension) over one chunk for the one-matmul scores:
#: their factors stay within e^{+-20}, the dropped entries within e^{40}
FACTORED_RANGE = 40.0


def _scores(
    qc: Tensor, kc: Tensor, ac: Tensor, bc: Tensor, gc: Tensor, ge: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(A_qk, A_qb, A_ak, A_ab)`` of one chunk step, each ``[B, H, nc, T, T]``."""
    T = qc.shape[-2]
    if T == 1 or float(gc[..., -1, :].detach().min()) < -FACTORED_RANGE:
        return (
            intra_chunk_scores(qc, kc, gc),
            intra_chunk_scores(qc, bc, gc),
            intra_chunk_scores(ac, kc, ge, gc, strict=True),
            intra_chunk_scores(ac, bc, ge, gc, strict=True),
        )
    mid = (gc[..., -1:, :] / 2).detach()  # [B, H, nc, 1, K]; the result does not depend on it
    col = (mid - gc).exp()  # [B, H, nc, T, K]
    rows = torch.cat((qc * (gc - mid).exp(), ac * (ge - mid).exp()), dim=-2)  # [.., 2T, K]
    cols = torch.cat((kc * col, bc * col), dim=-2)  # [.., 2T, K]
    s = rows @ cols.transpose(-1, -2)  # [B, H, nc, 2T, 2T]
    incl = torch.ones(T, T, dtype=torch.bool, device=qc.device).tril()
    keep = torch.cat((incl.repeat(1, 2), incl.tril(-1).repeat(1, 2)), dim=0)  # [2T, 2T]
    s = torch.where(keep, s, s.new_zeros(()))
    return s[..., :T, :T], s[..., :T, T:], s[..., T:, :T], s[..., T:, T:]


def _check(
    q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, gk: Tensor, state: Tensor | None
) -> tuple[int, int, int, int, int]:
    check_float("q", q)
    if q.dim() != 4:
        raise ValueError(f"q must be (batch, heads, seq_len, key_dim), got {tuple(q.shape)}")
    bs, h, l, dk = q.shape
    for name, t in (("k", k), ("a", a), ("b", b), ("gk", gk)):
        check_shape(name, t, (bs, h, l, dk), "(batch, heads, seq_len, key_dim) as q")
    check_float("v", v)
    if v.dim() != 4 or v.shape[:3] != (bs, h, l):
        raise ValueError(
            f"v must be (batch={bs}, heads={h}, seq_len={l}, value_dim), got {tuple(v.shape)}"
        )
    dv = v.shape[-1]
    if state is not None:
        check_shape("state", state, (bs, h, dk, dv), "(batch, heads, key_dim, value_dim)")
    return bs, h, l, dk, dv


def _masked(
    k: Tensor, b: Tensor, gk: Tensor, mask: Tensor | None, bs: int, l: int
) -> tuple[Tensor, Tensor, Tensor]:
    m = token_mask(mask, bs, l, k)
    if m is None:
        return k, b, gk
    m = m[:, None, :, None]
    return k * m, b * m, gk * m


def rwkv7_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    gk: Tensor,
    state: Tensor,
    *,
    scale: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """One token: ``q, k, a, b, gk [B, H, K]``, ``v [B, H, V]``, ``state [B, H, K, V]``.

    Returns:
        ``(o [B, H, V], state after the token [B, H, K, V])``.
    """
    u = torch.einsum("bhk,bhkv->bhv", a, state)  # the read, before the decay
    s = (
        gk.exp()[..., None] * state
        + k[..., :, None] * v[..., None, :]
        + b[..., :, None] * u[..., None, :]
    )
    return torch.einsum("bhk,bhkv->bhv", q * scale, s), s


def rwkv7_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    gk: Tensor,
    *,
    scale: float = 1.0,
    state: Tensor | None = None,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The generalized delta rule one token at a time (the reference).

    Args:
        q: ``[B, H, L, K]`` receptance (RWKV's ``r``).
        k: ``[B, H, L, K]`` keys.
        v: ``[B, H, L, V]`` values.
        a: ``[B, H, L, K]`` what the state is read with (RWKV-7: ``-kappa``).
        b: ``[B, H, L, K]`` where the read is written back (RWKV-7: ``kappa . a``).
        gk: ``[B, H, L, K]`` log decays ``<= 0`` (RWKV-7: ``-e^{-0.5} sigmoid(.)``).
        scale: query scale (RWKV-7: 1).
        state: ``[B, H, K, V]`` state before the first token (default zeros).
        mask: ``[B, L]`` 1 = token, 0 = padding (skipped).

    Returns:
        ``(o [B, H, L, V], state after the last token [B, H, K, V])``.

    Raises:
        ValueError: shapes that do not fit (named).
        TypeError: a non-floating tensor.
    """
    bs, h, l, dk, dv = _check(q, k, v, a, b, gk, state)
    k, b, gk = _masked(k, b, gk, mask, bs, l)
    s = state if state is not None else q.new_zeros((bs, h, dk, dv))
    out = []
    for t in range(l):
        o_t, s = rwkv7_step(
            q[:, :, t], k[:, :, t], v[:, :, t], a[:, :, t], b[:, :, t], gk[:, :, t], s, scale=scale
        )
        out.append(o_t)
    o = torch.stack(out, dim=2) if out else q.new_zeros((bs, h, 0, dv))
    return o, s


def rwkv7_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    gk: Tensor,
    *,
    scale: float = 1.0,
    state: Tensor | None = None,
    mask: Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """The generalized delta rule in chunks of ``chunk_size`` tokens.

    Arguments and returns as :func:`rwkv7_reference`, plus ``chunk_size`` (``T``): four
    decayed score matrices and one unit-triangular solve per chunk, ``L / T`` chunk steps.
    """
    T = check_chunk_size(chunk_size)
    bs, h, l, dk, dv = _check(q, k, v, a, b, gk, state)
    k, b, gk = _masked(k, b, gk, mask, bs, l)
    q = q * scale
    nc = max(1, -(-l // T))
    pad = nc * T - l
    if pad:  # padded tail: zero keys and write-backs, no decay
        q, k, v, a, b, gk = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, a, b, gk))

    def chunks(x: Tensor) -> Tensor:
        return x.reshape(bs, h, nc, T, x.shape[-1])

    qc, kc, vc, ac, bc = (chunks(x) for x in (q, k, v, a, b))
    g_own = chunks(gk)
    gc = g_own.cumsum(-2)  # log G_i
    ge = gc - g_own  # log G_{i-1}: the decay before token i's own
    qk, qb, ak, ab = _scores(qc, kc, ac, bc, gc, ge)
    # U = (I - A_ab)^{-1} (A_ak V + (a . G_{i-1}) S_0) = w_v + w_s S_0
    w_v = torch.linalg.solve_triangular(-ab, ak @ vc, upper=False, unitriangular=True)
    w_s = torch.linalg.solve_triangular(-ab, ac * ge.exp(), upper=False, unitriangular=True)
    q_dec = qc * gc.exp()  # reads S_0 decayed to each token
    to_end = (gc[..., -1:, :] - gc).exp()
    k_dec, b_dec = kc * to_end, bc * to_end  # writes decayed to the chunk's end
    chunk_decay = gc[..., -1, :].exp()[..., None]  # [B, H, nc, K, 1]
    kv = qk @ vc  # [B, H, nc, T, V]
    writes = k_dec.transpose(-1, -2) @ vc  # [B, H, nc, K, V]
    s = state if state is not None else q.new_zeros((bs, h, dk, dv))
    # only the state's carry runs chunk by chunk, over chunks unbound once (indexing
    # x[:, :, c] in the loop would cost a full-size zero gradient per chunk in backward)
    starts, us = [], []
    for w_vc, w_sc, dc, wr, b_c in zip(
        w_v.unbind(2),
        w_s.unbind(2),
        chunk_decay.unbind(2),
        writes.unbind(2),
        b_dec.transpose(-1, -2).unbind(2),
    ):
        starts.append(s)
        u = w_vc + w_sc @ s  # [B, H, T, V]
        us.append(u)
        s = dc * s + wr + b_c @ u
    o = q_dec @ torch.stack(starts, dim=2) + kv + qb @ torch.stack(us, dim=2)
    return o.reshape(bs, h, nc * T, dv)[:, :, :l], s
