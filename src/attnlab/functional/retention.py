"""Multi-scale retention (RetNet): recurrent, parallel and chunkwise forms.

Sun et al. (2023), "Retentive network: a successor to Transformer for large language
models", eq. 1-8. Per head with decay ``gamma`` (0 < gamma < 1):

    recurrent:  S_n = gamma S_{n-1} + k_n^T v_n,     o_n = q_n S_n
    parallel:   O = (Q K^T * D) V,                    D[n, m] = gamma^(n-m) if n >= m else 0
    chunkwise:  inside a chunk the parallel form; across chunks the state
                R_i = gamma^T R_{i-1} + K_i^T (V_i * gamma^(T-1-j)), read as
                (Q_i R_{i-1}) * gamma^(j+1)

These are the paper's equations with no normalisation: the module
(:class:`~attnlab.modules.retention.MultiScaleRetention`) applies the group norm, which
makes the output invariant to the per-row scalings RetNet's code adds for stability.

Shape notation: ``B`` batch, ``H`` heads, ``L`` tokens, ``K`` key dim, ``V`` value dim,
``T`` chunk size.

Padding: where ``mask`` is 0 the token is skipped (no decay, no input): decay exponents
count the real tokens between two positions, so a left-padded row equals the row alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.functional._scan_checks import check_chunk_size, check_float, check_shape, token_mask

__all__ = ["retention_chunkwise", "retention_parallel", "retention_recurrent"]


def _check(
    q: Tensor, k: Tensor, v: Tensor, gamma: Tensor, state: Tensor | None
) -> tuple[int, int, int, int, int]:
    check_float("q", q)
    if q.dim() != 4:
        raise ValueError(f"q must be (batch, heads, seq_len, key_dim), got {tuple(q.shape)}")
    b, h, l, dk = q.shape
    check_shape("k", k, (b, h, l, dk), "(batch, heads, seq_len, key_dim) as q")
    check_float("v", v)
    if v.dim() != 4 or v.shape[:3] != (b, h, l):
        raise ValueError(
            f"v must be (batch={b}, heads={h}, seq_len={l}, value_dim), got {tuple(v.shape)}"
        )
    dv = v.shape[-1]
    check_shape("gamma", gamma, (h,), "(heads,)")
    if bool(((gamma <= 0) | (gamma > 1)).any()):
        raise ValueError(f"gamma must lie in (0, 1], got {gamma.tolist()}")
    if state is not None:
        check_shape("state", state, (b, h, dk, dv), "(batch, heads, key_dim, value_dim)")
    return b, h, l, dk, dv


def _counts(mask: Tensor | None, b: int, l: int, like: Tensor) -> tuple[Tensor, Tensor]:
    """``(m [B, L] 1/0, c [B, L])``: c = real tokens up to and including each position."""
    m = token_mask(mask, b, l, like)
    if m is None:
        m = like.new_ones((b, l))
    return m, torch.cumsum(m, dim=1)


def retention_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gamma: Tensor,
    *,
    state: Tensor | None = None,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Retention one token at a time (the recurrent form, eq. 6).

    Args:
        q: ``[B, H, L, K]`` queries (already rotated by xPos/RoPE if the model uses it).
        k: ``[B, H, L, K]`` keys.
        v: ``[B, H, L, V]`` values.
        gamma: ``[H]`` decay per head in ``(0, 1]``.
        state: ``[B, H, K, V]`` state before the first token (default zeros).
        mask: ``[B, L]`` 1 = token, 0 = padding (skipped).

    Returns:
        ``(o [B, H, L, V], state after the last token [B, H, K, V])``.

    Raises:
        ValueError: shapes that do not fit (named), gamma outside ``(0, 1]``.
        TypeError: a non-floating tensor.
    """
    b, h, l, dk, dv = _check(q, k, v, gamma, state)
    m, _ = _counts(mask, b, l, q)
    s = state if state is not None else q.new_zeros((b, h, dk, dv))
    g = gamma[None, :, None, None]
    out = []
    for t in range(l):
        mt = m[:, t, None, None, None]
        new = g * s + torch.einsum("bhk,bhv->bhkv", k[:, :, t], v[:, :, t])
        s = mt * new + (1 - mt) * s
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], s))
    o = torch.stack(out, dim=2) if out else q.new_zeros((b, h, 0, dv))
    return o, s


def _decay_matrix(gamma: Tensor, c_q: Tensor, c_k: Tensor, m_k: Tensor) -> Tensor:
    """``gamma^(c_q - c_k)`` where the key is a real token at or before the query, else 0.

    ``c_q [B, Lq]``, ``c_k, m_k [B, Lk]`` (inclusive counts, 1/0 mask); returns ``[B, H, Lq, Lk]``.
    Positions are compared by counts, so "at or before" is ``c_k <= c_q`` for a real key;
    the caller passes key columns that precede or equal the query rows in time.
    """
    # keys after the query give negative exponents: clamp so gamma^(-n) never overflows
    diff = (c_q[:, None, :, None] - c_k[:, None, None, :]).clamp(min=0).to(gamma.dtype)
    d = torch.exp(diff * torch.log(gamma)[None, :, None, None])
    return d * m_k[:, None, None, :]


def retention_parallel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gamma: Tensor,
    *,
    state: Tensor | None = None,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Retention as one masked matrix product (the parallel form, eq. 5).

    Arguments and returns as :func:`retention_recurrent`; ``O(L^2)`` memory.
    """
    b, _, l, _, _ = _check(q, k, v, gamma, state)
    m, c = _counts(mask, b, l, q)
    causal = torch.ones(l, l, dtype=torch.bool, device=q.device).tril()
    D = _decay_matrix(gamma, c, c, m) * causal  # [B, H, L, L]
    o = torch.einsum("bhnk,bhmk,bhnm,bhmv->bhnv", q, k, D, v)
    log_g = torch.log(gamma)[None, :, None]
    # the final state: every real key decayed to the end
    to_end = torch.exp((c[:, -1:] - c)[:, None, :] * log_g) * m[:, None, :]  # [B, H, L]
    s = torch.einsum("bhlk,bhl,bhlv->bhkv", k, to_end, v)
    if state is not None:
        from_start = torch.exp(c[:, None, :] * log_g)  # [B, H, L]
        o = o + torch.einsum("bhnk,bhkv,bhn->bhnv", q, state, from_start)
        s = s + state * torch.exp(c[:, -1, None, None, None] * log_g[..., None])
    return o, s


def retention_chunkwise(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gamma: Tensor,
    *,
    state: Tensor | None = None,
    mask: Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """Retention in chunks of ``chunk_size`` tokens (the chunkwise recurrent form, eq. 7).

    Arguments and returns as :func:`retention_recurrent`, plus ``chunk_size`` (``T``).
    Memory is ``O(L T)``; the inter-chunk recurrence runs ``L / T`` steps.
    """
    T = check_chunk_size(chunk_size)
    b, h, l, dk, dv = _check(q, k, v, gamma, state)
    m, c = _counts(mask, b, l, q)
    nc = max(1, -(-l // T))
    pad = nc * T - l
    if pad:
        q = F.pad(q, (0, 0, 0, pad))
        k = F.pad(k, (0, 0, 0, pad))
        v = F.pad(v, (0, 0, 0, pad))
        m = F.pad(m, (0, pad))
        c = torch.cat((c, c[:, -1:].expand(b, pad)), dim=1)
    qc = q.view(b, h, nc, T, dk)
    kc = k.view(b, h, nc, T, dk)
    vc = v.view(b, h, nc, T, dv)
    mc = m.view(b, nc, T)
    cc = c.view(b, nc, T)
    c0 = cc[..., :1] - mc[..., :1]  # [B, nc, 1]: real tokens before each chunk
    rel = cc - c0  # [B, nc, T]: counts inside the chunk
    log_g = torch.log(gamma)[None, :, None, None]  # [1, H, 1, 1]
    # 1. inside each chunk
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    diff = (rel[:, :, :, None] - rel[:, :, None, :]).clamp(min=0).to(q.dtype)  # [B, nc, T, T]
    D = torch.exp(diff[:, None] * log_g[..., None]) * (mc[:, None, :, None, :] * causal)
    inner = torch.einsum("bhcik,bhcjk,bhcij,bhcjv->bhciv", qc, kc, D, vc)
    # 2. per-chunk contributions to the state, and the decay of a chunk
    to_end = torch.exp((rel[..., -1:] - rel)[:, None] * log_g) * mc[:, None]  # [B, H, nc, T]
    chunk_kv = torch.einsum("bhctk,bhct,bhctv->bhckv", kc, to_end, vc)  # [B, H, nc, K, V]
    chunk_decay = torch.exp(rel[:, None, :, -1] * log_g[..., 0])  # [B, H, nc]
    # 3. carry the state across chunks
    s = state if state is not None else q.new_zeros((b, h, dk, dv))
    starts = []
    for ci in range(nc):
        starts.append(s)
        s = chunk_decay[:, :, ci, None, None] * s + chunk_kv[:, :, ci]
    R = torch.stack(starts, dim=2)  # [B, H, nc, K, V]
    # 4. every token reads the state its chunk starts from, decayed to it
    from_start = torch.exp(rel[:, None] * log_g)  # [B, H, nc, T]
    cross = torch.einsum("bhctk,bhckv,bhct->bhctv", qc, R, from_start)
    o = (inner + cross).reshape(b, h, nc * T, dv)[:, :, :l]
    return o, s
