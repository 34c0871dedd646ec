"""The state-space duality (SSD) scan of Mamba-2: sequential reference and chunked form.

Dao & Gu (2024), "Transformers are SSMs: generalized models and efficient algorithms
through structured state space duality", section 6 (the SSD algorithm). Mamba-2 restricts
``A`` to a scalar per head, so per head ``h``, with ``P`` channels and state size ``N``:

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T           (state [P, N])
    y_t = h_t C_t + D x_t

The chunked form splits the sequence into chunks of ``T`` tokens: inside a chunk the
output is a masked matrix product (the "dual", attention-like form) with the decay
matrix ``exp(segsum(dt A))``; the chunk-end states are carried across chunks with the
same decay rule on chunk totals; each chunk then reads the carried state.

Shape notation: ``B`` batch, ``L`` tokens, ``H`` heads, ``P`` head dim, ``G`` groups of
``B``/``C`` (heads share them as GQA shares keys), ``N`` state size, ``T`` chunk size.

Padding: where ``mask`` is 0 the step is skipped (``dt = 0``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.functional._scan_checks import check_chunk_size, check_float, check_shape, token_mask

__all__ = ["segsum", "ssd_chunked", "ssd_reference"]


def segsum(x: Tensor) -> Tensor:
    """Segment sums ``out[..., i, j] = x[..., j+1] + ... + x[..., i]`` for ``i >= j``, else -inf.

    Summed directly (not as a difference of cumulative sums), so it is exact to rounding
    even when the cumulative sums are large. ``x [..., T] -> [..., T, T]``.
    """
    t = x.shape[-1]
    xs = x[..., None, :].expand(*x.shape, t).transpose(-1, -2)  # [..., T(i), T(j)] = x[i]
    strict = torch.ones(t, t, dtype=torch.bool, device=x.device).tril(-1)
    out = torch.cumsum(xs.masked_fill(~strict, 0.0), dim=-2)
    lower = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
    return out.masked_fill(~lower, float("-inf"))


def _prepare(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    dt_bias: Tensor | None,
    dt_softplus: bool,
    mask: Tensor | None,
    initial_state: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Validate; return ``(dt [B, L, H], B [B, L, H, N], C [B, L, H, N])`` per head."""
    check_float("x", x)
    if x.dim() != 4:
        raise ValueError(f"x must be (batch, seq_len, heads, head_dim), got {tuple(x.shape)}")
    b, l, h, p = x.shape
    check_shape("dt", dt, (b, l, h), "(batch, seq_len, heads)")
    check_shape("A", A, (h,), "(heads,)")
    check_float("B", B)
    if B.dim() != 4 or B.shape[:2] != (b, l):
        raise ValueError(
            f"B must be (batch={b}, seq_len={l}, groups, state_size), got {tuple(B.shape)}"
        )
    g, n = B.shape[2:]
    if h % g:
        raise ValueError(f"heads ({h}) must be divisible by the groups of B and C ({g})")
    check_shape("C", C, (b, l, g, n), "(batch, seq_len, groups, state_size)")
    if D is not None:
        check_shape("D", D, (h,), "(heads,)")
    if dt_bias is not None:
        check_shape("dt_bias", dt_bias, (h,), "(heads,)")
        dt = dt + dt_bias
    if initial_state is not None:
        check_shape(
            "initial_state", initial_state, (b, h, p, n), "(batch, heads, head_dim, state_size)"
        )
    if dt_softplus:
        dt = F.softplus(dt)
    m = token_mask(mask, b, l, dt)
    if m is not None:
        dt = dt * m[..., None]
    if g != h:
        B = B.repeat_interleave(h // g, dim=2)
        C = C.repeat_interleave(h // g, dim=2)
    return dt, B, C


def ssd_reference(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    *,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
    mask: Tensor | None = None,
    initial_state: Tensor | None = None,
    return_final_state: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Mamba-2's scan, one token at a time (the definition).

    Args:
        x: ``[B, L, H, P]`` input.
        dt: ``[B, L, H]`` step sizes (before ``dt_bias``/softplus when given).
        A: ``[H]`` scalar state matrix per head (negative for decay).
        B: ``[B, L, G, N]`` input matrices; ``H`` must be a multiple of ``G``.
        C: ``[B, L, G, N]`` output matrices.
        D: ``[H]`` skip connection, or None.
        dt_bias: ``[H]`` added to ``dt`` first.
        dt_softplus: apply softplus to ``dt`` (after the bias).
        mask: ``[B, L]`` 1 = token, 0 = padding (skipped step).
        initial_state: ``[B, H, P, N]`` (default zeros).
        return_final_state: also return the final state.

    Returns:
        ``y [B, L, H, P]``, and the final state ``[B, H, P, N]`` when asked for.

    Raises:
        ValueError: shapes that do not fit (named), heads not a multiple of groups.
        TypeError: a non-floating tensor.
    """
    dt, Bh, Ch = _prepare(x, dt, A, B, C, D, dt_bias, dt_softplus, mask, initial_state)
    b, l, h, p = x.shape
    n = Bh.shape[-1]
    state = initial_state if initial_state is not None else x.new_zeros((b, h, p, n))
    decay = torch.exp(dt * A)  # [B, L, H]
    ys = []
    for t in range(l):
        upd = torch.einsum("bhp,bhn->bhpn", dt[:, t, :, None] * x[:, t], Bh[:, t])
        state = decay[:, t, :, None, None] * state + upd  # [B, H, P, N]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]))
    y = torch.stack(ys, dim=1) if ys else x.new_zeros((b, 0, h, p))  # [B, L, H, P]
    if D is not None:
        y = y + x * D[:, None]
    return (y, state) if return_final_state else y


def ssd_chunked(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    *,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
    mask: Tensor | None = None,
    initial_state: Tensor | None = None,
    return_final_state: bool = False,
    chunk_size: int = 64,
) -> Tensor | tuple[Tensor, Tensor]:
    """The SSD algorithm in chunks of ``chunk_size`` tokens: equal to :func:`ssd_reference`.

    Arguments and returns as :func:`ssd_reference`, plus ``chunk_size`` (``T``, any
    positive int; the sequence is padded to a multiple of it with skipped steps).
    """
    T = check_chunk_size(chunk_size)
    dt, Bh, Ch = _prepare(x, dt, A, B, C, D, dt_bias, dt_softplus, mask, initial_state)
    b, l, h, p = x.shape
    n = Bh.shape[-1]
    nc = max(1, -(-l // T))
    pad = nc * T - l
    xs = x
    if pad:
        xs = F.pad(x, (0, 0, 0, 0, 0, pad))
        dt = F.pad(dt, (0, 0, 0, pad))
        Bh = F.pad(Bh, (0, 0, 0, 0, 0, pad))
        Ch = F.pad(Ch, (0, 0, 0, 0, 0, pad))
    X = (xs * dt[..., None]).view(b, nc, T, h, p)  # [B, c, T, H, P]
    Bc = Bh.view(b, nc, T, h, n)
    Cc = Ch.view(b, nc, T, h, n)
    dA = (dt * A).view(b, nc, T, h).permute(0, 3, 1, 2)  # [B, H, c, T]
    cum = torch.cumsum(dA, dim=-1)  # [B, H, c, T]
    # 1. inside each chunk: the masked, decayed "attention" form
    Lmat = torch.exp(segsum(dA))  # [B, H, c, T(i), T(j)]
    scores = torch.einsum("bcihn,bcjhn->bhcij", Cc, Bc) * Lmat
    y_diag = torch.einsum("bhcij,bcjhp->bcihp", scores, X)
    # 2. each chunk's own end state
    to_end = torch.exp(cum[..., -1:] - cum)  # [B, H, c, T]
    states = torch.einsum("bcjhn,bhcj,bcjhp->bchpn", Bc, to_end, X)  # [B, c, H, P, N]
    # 3. carry states across chunks (a recurrence on chunk totals, as a decay matrix)
    s0 = initial_state if initial_state is not None else x.new_zeros((b, h, p, n))
    states = torch.cat((s0[:, None], states), dim=1)  # [B, c+1, H, P, N]
    chunk_decay = torch.exp(segsum(F.pad(cum[..., -1], (1, 0))))  # [B, H, c+1, c+1]
    carried = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)  # [B, c+1, H, P, N]
    starts, final = carried[:, :-1], carried[:, -1]
    # 4. each chunk reads the state it starts from
    y_off = torch.einsum("bcihn,bchpn,bhci->bcihp", Cc, starts, torch.exp(cum))
    y = (y_diag + y_off).reshape(b, nc * T, h, p)[:, :l]  # [B, L, H, P]
    if D is not None:
        y = y + x * D[:, None]
    return (y, final) if return_final_state else y
