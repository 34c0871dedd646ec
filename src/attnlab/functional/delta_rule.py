"""The (gated) delta rule: DeltaNet and Gated DeltaNet, recurrent, one-step and chunked forms.

Schlag et al. (2021), "Linear transformers are secretly fast weight programmers" (the
delta rule); Yang et al. (2024), "Parallelizing linear transformers with the delta rule
over sequence length" (the chunked WY/UT form); Yang et al. (2025), "Gated delta networks:
improving Mamba2 with delta rule" (the decay ``alpha_t = exp(g_t)``, as Qwen3-Next uses it).
Per head, with the state ``S [K, V]`` (keys index rows):

    S_t = exp(g_t) S_{t-1}                             (decay; DeltaNet: g = 0)
    u_t = beta_t (v_t - S_t^T k_t)                     (the correction the state lacks)
    S_t = S_t + k_t u_t^T,        o_t = S_t^T (scale q_t)

Chunked (chunk of ``T`` tokens starting from ``S_0``, ``G_i`` the decay accumulated from
the chunk's start to token ``i``): ``S_i = G_i S_0 + sum_{j<=i} (G_i/G_j) k_j u_j^T``, so
the corrections solve one unit lower-triangular system per chunk,
``(I + A) U = beta V - beta G K S_0`` with ``A_ij = beta_i (G_i/G_j) k_i.k_j`` for ``j < i``
(the UT transform), and ``o_i = G_i q_i^T S_0 + sum_{j<=i} (G_i/G_j) (q_i.k_j) u_j``.

Shape notation: ``B`` batch, ``H`` heads, ``L`` tokens, ``K`` key dim, ``V`` value dim,
``T`` chunk size. ``q``/``k`` are used as given: models L2-normalise them (the update is
stable when ``beta ||k||^2 <= 2``).

Padding: where ``mask`` is 0 the token is skipped (``beta = 0``, ``g = 0``: the state is
unchanged), so a left-padded row equals the row alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.functional._scan_checks import check_chunk_size, check_float, check_shape, token_mask

__all__ = ["delta_rule_chunked", "delta_rule_reference", "delta_rule_step"]


def _check(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    g: Tensor | None,
    state: Tensor | None,
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
    check_shape("beta", beta, (b, h, l), "(batch, heads, seq_len)")
    if g is not None:
        check_shape("g", g, (b, h, l), "(batch, heads, seq_len)")
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


def _masked(
    beta: Tensor, g: Tensor | None, mask: Tensor | None, b: int, l: int
) -> tuple[Tensor, Tensor]:
    """``beta`` and ``g`` (zeros for DeltaNet) with padded steps turned into no-ops."""
    m = token_mask(mask, b, l, beta)
    g = g if g is not None else torch.zeros_like(beta)
    if m is None:
        return beta, g
    return beta * m[:, None], g * m[:, None]


def delta_rule_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    state: Tensor,
    *,
    g: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """One token of the (gated) delta rule: the decoding step.

    Args:
        q: ``[B, H, K]`` query.
        k: ``[B, H, K]`` key.
        v: ``[B, H, V]`` value.
        beta: ``[B, H]`` write strength (0 leaves the state unchanged).
        state: ``[B, H, K, V]`` the state before the token.
        g: ``[B, H]`` log decay (``<= 0``); None for DeltaNet (no decay).
        scale: query scale (default ``1/sqrt(K)``).

    Returns:
        ``(o [B, H, V], state after the token [B, H, K, V])``.
    """
    s = state if g is None else state * g.exp()[..., None, None]
    kv = torch.einsum("bhk,bhkv->bhv", k, s)  # what the state recalls for k
    u = beta[..., None] * (v - kv)
    s = s + k[..., :, None] * u[..., None, :]
    o = torch.einsum("bhk,bhkv->bhv", q * _scale(scale, q.shape[-1]), s)
    return o, s


def delta_rule_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    *,
    g: Tensor | None = None,
    scale: float | None = None,
    state: Tensor | None = None,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The (gated) delta rule one token at a time (the recurrent form; the reference).

    Args:
        q: ``[B, H, L, K]`` queries.
        k: ``[B, H, L, K]`` keys (L2-normalised by the models).
        v: ``[B, H, L, V]`` values.
        beta: ``[B, H, L]`` write strengths, usually in ``(0, 1)`` (a sigmoid).
        g: ``[B, H, L]`` log decays ``<= 0`` (Gated DeltaNet), or None (DeltaNet).
        scale: query scale (default ``1/sqrt(K)``).
        state: ``[B, H, K, V]`` state before the first token (default zeros).
        mask: ``[B, L]`` 1 = token, 0 = padding (skipped).

    Returns:
        ``(o [B, H, L, V], state after the last token [B, H, K, V])``.

    Raises:
        ValueError: shapes that do not fit (named), a non-positive scale.
        TypeError: a non-floating tensor.
    """
    b, h, l, dk, dv = _check(q, k, v, beta, g, state)
    beta, gm = _masked(beta, g, mask, b, l)
    s = state if state is not None else q.new_zeros((b, h, dk, dv))
    out = []
    for t in range(l):
        o_t, s = delta_rule_step(
            q[:, :, t], k[:, :, t], v[:, :, t], beta[:, :, t], s, g=gm[:, :, t], scale=scale
        )
        out.append(o_t)
    o = torch.stack(out, dim=2) if out else q.new_zeros((b, h, 0, dv))
    return o, s


def delta_rule_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    *,
    g: Tensor | None = None,
    scale: float | None = None,
    state: Tensor | None = None,
    mask: Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """The (gated) delta rule in chunks of ``chunk_size`` tokens (the WY/UT form).

    Arguments and returns as :func:`delta_rule_reference`, plus ``chunk_size`` (``T``).
    Per chunk: one batched unit-triangular solve and a few ``T x T`` matmuls; the
    inter-chunk recurrence runs ``L / T`` steps. Memory is ``O(L T)``.
    """
    T = check_chunk_size(chunk_size)
    b, h, l, dk, dv = _check(q, k, v, beta, g, state)
    beta, gm = _masked(beta, g, mask, b, l)
    q = q * _scale(scale, dk)
    nc = max(1, -(-l // T))
    pad = nc * T - l
    if pad:  # padded tail: beta = g = 0 and zero keys leave the state alone
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        beta, gm = (F.pad(x, (0, pad)) for x in (beta, gm))
    qc = q.reshape(b, h, nc, T, dk)
    kc = k.reshape(b, h, nc, T, dk)
    vc = v.reshape(b, h, nc, T, dv)
    bc = beta.reshape(b, h, nc, T, 1)
    gc = gm.reshape(b, h, nc, T).cumsum(-1)  # log G_i inside each chunk
    upper = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(upper, float("-inf")).exp()
    # the UT transform: (I + A) [U_v, U_k] = [beta V, beta G K]
    A = (bc * kc @ kc.transpose(-1, -2)) * decay  # [B, H, nc, T, T], the diagonal unread
    w_v = torch.linalg.solve_triangular(A, bc * vc, upper=False, unitriangular=True)
    w_k = torch.linalg.solve_triangular(
        A, bc * kc * gc.exp()[..., None], upper=False, unitriangular=True
    )
    scores = (qc @ kc.transpose(-1, -2)) * decay  # [B, H, nc, T, T], causal incl. diagonal
    q_dec = qc * gc.exp()[..., None]  # reads S_0 decayed to each token
    k_dec = kc * (gc[..., -1:] - gc).exp()[..., None]  # writes decayed to the chunk's end
    chunk_decay = gc[..., -1].exp()[..., None, None]  # [B, H, nc, 1, 1]
    s = state if state is not None else q.new_zeros((b, h, dk, dv))
    # only the state's carry runs chunk by chunk; the chunks are unbound once (indexing
    # x[:, :, c] in the loop would cost a full-size zero gradient per chunk in backward)
    starts, us = [], []
    for w_vc, w_kc, dc, k_c in zip(
        w_v.unbind(2), w_k.unbind(2), chunk_decay.unbind(2), k_dec.transpose(-1, -2).unbind(2)
    ):
        starts.append(s)
        u = w_vc - w_kc @ s  # [B, H, T, V]
        us.append(u)
        s = dc * s + k_c @ u
    o = q_dec @ torch.stack(starts, dim=2) + scores @ torch.stack(us, dim=2)
    return o.reshape(b, h, nc * T, dv)[:, :, :l], s
