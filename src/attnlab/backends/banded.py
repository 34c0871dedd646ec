"""The ``sparse`` backend's banded path: diagonals of key blocks, read in place, plus a few keys.

Many sparse patterns are a band of tiles around the diagonal plus a handful of columns:
a sliding window (Beltagy et al., 2020, "Longformer", sec. 3.1; Child et al., 2019),
Longformer's window with global keys, BigBird's window and global tokens without the
random blocks (Zaheer et al., 2020). Cut queries and keys into blocks of ``b``; query
block ``i`` then needs key blocks ``i + d`` for a fixed set of offsets ``D`` (the band)
and a few key columns that every query block may need (the global keys).

The block-gather path of :mod:`attnlab.backends.sparse` copies every query block's key
and value blocks side by side (an indexed gather, as large as the scores themselves).
Here the keys are laid out block-major once (``[blocks, N, H, b, E]``, one copy of
``K``), so that the key blocks at offset ``d`` of *every* query block are one contiguous
slice: one batched product per offset, no gather. The few extra keys are gathered
individually, not as blocks (three global tokens are three keys, not three 64-key
blocks). The softmax runs over all offsets and the extra keys at once, as an ordinary
(safe) softmax; the output is the sum over offsets of the weights times that offset's
value blocks, again one batched product per offset. The work is ``L * (|D| * b + X)``
pairs per head, close to the ``L * (2w + 1 + G)`` the pattern attends, and the score
tensor is split in groups of query blocks under the same budget as the gather path.

A pair that the band already covers is masked out of the extra keys, so no pair is
counted twice; every other pair is masked by the pattern evaluated on the query and key
positions, as in every backend. The plan (:func:`band_plan`) is taken only when every
needed tile is covered and the band computes at most ``MAX_WASTE`` times the tiles the
block mask needs: a causal or full mask (whose "band" is the whole matrix) goes to the
gather path or to another backend.

Shape notation: ``N`` flattened batch, ``H`` heads, ``L`` query length, ``S`` key length,
``E`` head dim, ``Ev`` value head dim, ``b`` block, ``nq``/``nk`` query/key blocks, ``W``
offsets in the band, ``X`` extra keys, ``g`` query blocks in a group, ``P`` 1 or ``N``
(rows of the positions).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.backends.blocks import MaskSpec
from attnlab.functional.masks import MaskPattern
from attnlab.functional.score_mods import apply_score_mods

__all__ = [
    "BAND_BLOCKS",
    "MAX_WASTE",
    "BandPlan",
    "band_pairs",
    "band_plan",
    "banded_core",
    "choose_band",
]

#: The band may compute at most this many times the tiles the block mask needs.
MAX_WASTE = 1.25
#: Block sizes the banded path tries, with the relative time per computed pair of the
#: whole banded kernel at that block (Longformer's pattern, 4096 tokens, 12 heads, head dim
#: 64, one thread, process time, this project's CPU: 64 blocks 385-410 ms for 576 keys per
#: query, 128 blocks 417-456 ms for 640, 256 blocks 574-628 ms for 768). The batched
#: products alone run faster at larger blocks (363, 204 and 160 ms for the same 31M pairs),
#: but the softmax's element-wise passes grow with the pairs outside the band, so only a
#: wide band gains from larger blocks. The plan with the lowest ``pairs x relative time``
#: runs.
BAND_BLOCKS: dict[int, float] = {64: 1.0, 128: 0.99, 256: 1.13}


@dataclass(frozen=True)
class BandPlan:
    """Which key blocks each query block meets: ``i + d`` for ``d`` in ``offsets``, plus columns.

    Attributes:
        offsets: the band, sorted block offsets ``d`` (key block ``i + d`` for query block ``i``).
        columns: key blocks outside the band that some query block needs (their keys are
            screened one by one for the extra keys).
        tiles: tiles the plan computes (``nq * len(offsets)`` plus the columns, counted whole).
        needed: tiles the block mask marks as needed.
    """

    offsets: tuple[int, ...]
    columns: tuple[int, ...]
    tiles: int
    needed: int


def band_plan(needed: Tensor) -> BandPlan | None:
    """A band plan covering every needed tile of ``needed`` ``[nq, nk]``, or None if none pays.

    An offset joins the band when at least half of the query blocks that have a key block
    at that offset need it; the needed tiles left over must fit in a few columns. The plan
    is refused when it would compute more than ``MAX_WASTE`` times the needed tiles.
    """
    nq, nk = needed.shape
    total = int(needed.sum())
    if nq == 0 or nk == 0 or total == 0:
        return None
    i, j = needed.nonzero(as_tuple=True)
    d = j - i  # offsets of the needed tiles, in -(nq-1)..nk-1
    counts = torch.bincount(d + nq - 1, minlength=nq + nk - 1)  # [nq + nk - 1]
    offs = torch.arange(-(nq - 1), nk)
    # Query blocks i with a key block i + d inside 0..nk-1.
    present = torch.minimum(torch.full_like(offs, nq), nk - offs) - torch.clamp(-offs, min=0)
    # Far corners (an offset only one or two query blocks have) never make a band.
    band = (counts > 0) & (2 * counts >= present) & (2 * present >= min(nq, nk))
    offsets = tuple(int(o) for o in offs[band].tolist())
    if not offsets:
        return None
    in_band = band[d + nq - 1]
    columns = tuple(int(c) for c in torch.unique(j[~in_band]).tolist())
    tiles = nq * (len(offsets) + len(columns))
    if tiles > MAX_WASTE * total:
        return None
    return BandPlan(offsets, columns, tiles, total)


def choose_band(
    block_mask: Callable[[int], tuple[Tensor, Tensor]], blocks: Sequence[int]
) -> tuple[int, BandPlan, Tensor] | None:
    """The cheapest band plan over ``blocks``: ``(block, plan, full tiles [nq, nk])``, or None.

    Args:
        block_mask: ``block -> (needed, full)``, the pattern's block mask at that block.
        blocks: the block sizes to try.
    """
    best: tuple[float, int, BandPlan, Tensor] | None = None
    for b in blocks:
        needed, full = block_mask(b)
        plan = band_plan(needed)
        if plan is None:
            continue
        nq = needed.shape[0]
        # The band's tiles whole, at the block's speed; about one extra key per column.
        cost = nq * b * (len(plan.offsets) * b * BAND_BLOCKS.get(b, 1.0) + len(plan.columns))
        if best is None or cost < best[0]:
            best = (cost, b, plan, full)
    return None if best is None else best[1:]


def band_pairs(pattern: MaskPattern, L: int, S: int, blocks: Sequence[int]) -> float | None:
    """Pairs per head the banded path computes for ``pattern`` at default positions, or None.

    ``L * (|D| * b + X)`` for the block :func:`choose_band` picks (the band's tiles whole,
    the extra keys one by one), weighted by that block's relative time per pair
    (:data:`BAND_BLOCKS`, 1 at 64), or None when no plan pays (the gather path then runs).
    For the cost model; the kernel itself plans on the call's own positions.
    """
    if L == 0 or S == 0:
        return None
    band = pattern._tile_band()
    if band is not None:  # a window or causal: closed form, no block mask at any length
        left, right = band
        if 2 * (left + right + 1) > max(L, S):  # (nearly) the whole matrix: no band pays
            return None
        return (
            min(
                pattern.tile_pairs(L, S, b, b) * BAND_BLOCKS.get(b, 1.0)
                for b in blocks
                if b <= max(L, S)
            )
            if any(b <= max(L, S) for b in blocks)
            else None
        )
    chosen = choose_band(lambda b: pattern.block_mask(L, S, b, b), blocks)
    if chosen is None:
        return None
    block, plan, _ = chosen
    pos_q, pos_k = torch.arange(L).unsqueeze(0), torch.arange(S).unsqueeze(0)
    extra = _extra_keys(plan, pattern, pos_q, pos_k, block)
    band_part = -(-L // block) * block * len(plan.offsets) * block * BAND_BLOCKS.get(block, 1.0)
    return float(band_part + L * int(extra.numel()))


def _extra_keys(
    plan: BandPlan, pattern: MaskPattern, q_pos: Tensor, k_pos: Tensor, block: int
) -> Tensor:
    """Keys of the plan's columns that some query attends outside the band: long ``[X]``.

    ``q_pos`` ``[P, L]`` and ``k_pos`` ``[P|1, S]`` are the call's positions.
    """
    device = k_pos.device
    if not plan.columns:
        return torch.zeros(0, dtype=torch.long, device=device)
    S = k_pos.shape[-1]
    cols = torch.tensor(plan.columns, device=device)
    keys = (cols[:, None] * block + torch.arange(block, device=device)).flatten()
    keys = keys[keys < S]  # [C*b]
    L = q_pos.shape[-1]
    offsets = torch.tensor(plan.offsets, device=device)
    k_sel = k_pos[:, keys]  # [P|1, C*b]
    used = torch.zeros(keys.numel(), dtype=torch.bool, device=device)  # [C*b]
    rows = max(1, (1 << 24) // max(1, keys.numel() * max(q_pos.shape[0], k_sel.shape[0])))
    for r0 in range(0, L, rows):  # bounded memory: rows x C*b pairs at a time
        r1 = min(L, r0 + rows)
        allowed = pattern.evaluate(q_pos[:, r0:r1], k_sel)[:, 0]  # [P', r, C*b]
        q_block = torch.arange(r0, r1, device=device) // block  # [r]
        covered = torch.isin((keys // block)[None, :] - q_block[:, None], offsets)  # [r, C*b]
        used |= (allowed & ~covered).flatten(0, 1).any(0)
    return keys[used]


def _block_major(x: Tensor, before: int, blocks: int, block: int) -> Tensor:
    """``[N, H, T, E] -> [before + blocks + after, N, H, b, E]``, zero blocks around, one copy."""
    N, H, T, E = x.shape
    after = blocks * block - T
    x = F.pad(x, (0, 0, before * block, after))  # [N, H, (before+blocks)*b + ..., E]
    n = x.shape[2] // block
    return x.view(N, H, n, block, E).permute(2, 0, 1, 3, 4).contiguous()  # [n, N, H, b, E]


@dataclass(frozen=True)
class _Blocked:
    """The inputs of one banded call laid out block-major, read by every group of query
    blocks: the band's key/value blocks with zero blocks around them, the extra keys, and
    the positions of both."""

    qb: Tensor  # [nq, N, H, b, E], scaled
    kb: Tensor  # [before+nk+after, N, H, b, E]
    vb: Tensor  # [before+nk+after, N, H, b, Ev]
    q_pos: Tensor  # [P, nq, b]
    k_pos: Tensor  # [P|1, before+nk+after, b]
    before: int
    block: int
    nk: int
    keys: int  # S
    offsets: Tensor  # [W]
    extra: Tensor  # [X] key indices outside the band
    kx: Tensor  # [N, H, X, E]
    vx: Tensor  # [N, H, X, Ev]
    kx_pos: Tensor  # [P|1, X]
    n_idx: Tensor  # [1, 1, N, 1, 1, 1]
    h_idx: Tensor  # [1, 1, 1, H, 1, 1]
    grad: bool


def banded_core(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spec: MaskSpec,
    scale: float,
    block: int,
    plan: BandPlan,
    full: Tensor,
    score_budget: int,
) -> tuple[Tensor, Tensor]:
    """Banded attention on flattened inputs: ``(out [N, H, L, Ev], lse [N, H, L])``.

    Args:
        q: ``[N, H, L, E]`` queries; ``k`` ``[N, H, S, E]``, ``v`` ``[N, H, S, Ev]``.
        spec: the call's mask (a pattern and positions; no dense mask).
        scale: multiplies the scores.
        block: ``b``, the block of the plan.
        plan: from :func:`band_plan` on the pattern's block mask at this ``block``.
        full: bool ``[nq, nk]`` (CPU), the tiles the pattern attends entirely (no element
            mask needed), from the same block mask.
        score_budget: most scores (``N * H * rows * keys``) computed at once.
    """
    assert spec.pattern is not None and spec.dense is None
    N, H, L, _ = q.shape
    S, Ev = k.shape[2], v.shape[-1]
    dev = q.device
    nq, nk = -(-L // block), -(-S // block)
    lo, hi = min(plan.offsets), max(plan.offsets)
    before = max(0, -lo)  # zero key blocks before block 0 and after block nk - 1
    after = max(0, nq - 1 + hi - (nk - 1))
    P = spec.q_pos.shape[0]
    k_pos = F.pad(spec.k_pos, (before * block, (nk + after) * block - S), value=-1)
    extra = _extra_keys(plan, spec.pattern, spec.q_pos, spec.k_pos, block)  # [X]
    band = _Blocked(
        qb=_block_major(q * scale, 0, nq, block),
        kb=_block_major(k, before, nk + after, block),
        vb=_block_major(v, before, nk + after, block),
        q_pos=F.pad(spec.q_pos, (0, nq * block - L)).view(P, nq, block),
        k_pos=k_pos.view(k_pos.shape[0], -1, block),
        before=before,
        block=block,
        nk=nk,
        keys=S,
        offsets=torch.tensor(plan.offsets, device=dev),
        extra=extra,
        kx=k[:, :, extra],
        vx=v[:, :, extra],
        kx_pos=spec.k_pos[:, extra],
        n_idx=torch.arange(N, device=dev).view(1, 1, N, 1, 1, 1),
        h_idx=torch.arange(H, device=dev).view(1, 1, 1, H, 1, 1),
        grad=torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad),
    )
    per_block = N * H * block * (len(plan.offsets) * block + int(extra.numel()))
    step = max(1, score_budget // max(1, per_block))  # query blocks per group
    outs: list[Tensor] = []
    lses: list[Tensor] = []
    for g0 in range(0, nq, step):
        g1 = min(nq, g0 + step)
        s, qp = _band_scores(band, plan, spec, full, g0, g1)
        sx = _extra_scores(band, spec, qp, g0, g1)
        o, lse = _weighted_values(band, plan, s, sx, g0)
        outs.append(o)
        lses.append(lse)
    out_all = torch.cat(outs).permute(1, 2, 0, 3, 4).reshape(N, H, nq * block, Ev)[:, :, :L]
    lse = torch.cat(lses).permute(1, 2, 0, 3).reshape(N, H, nq * block)[:, :, :L]
    return out_all, lse


def _band_scores(
    band: _Blocked, plan: BandPlan, spec: MaskSpec, full: Tensor, g0: int, g1: int
) -> tuple[Tensor, Tensor]:
    """The masked scores of query blocks ``g0..g1-1`` against their band:
    ``(s [W, g, N, H, b, b], q positions [P, g, b])``."""
    assert spec.pattern is not None
    qb, kb, before, block = band.qb, band.kb, band.before, band.block
    _, N, H, _, E = qb.shape
    W = len(plan.offsets)
    dev = qb.device
    g = g1 - g0
    q_flat = qb[g0:g1].reshape(g * N * H, block, E)
    # Band: key blocks g0 + d .. g1 - 1 + d of the padded layout, for every offset d.
    if band.grad:
        s = torch.stack(
            [
                torch.bmm(
                    q_flat,
                    kb[before + d + g0 : before + d + g1]
                    .reshape(g * N * H, block, E)
                    .transpose(1, 2),
                )
                for d in plan.offsets
            ]
        )
    else:
        s = qb.new_empty(W, g * N * H, block, block)
        for j, d in enumerate(plan.offsets):
            kd = kb[before + d + g0 : before + d + g1].reshape(g * N * H, block, E)
            torch.bmm(q_flat, kd.transpose(1, 2), out=s[j])
    s = s.view(W, g, N, H, block, block)  # [W, g, N, H, b, b]
    blk = band.offsets[:, None] + torch.arange(g0, g1, device=dev)  # [W, g] key block indices
    slot = before + blk  # [W, g] in the padded layout
    qp = band.q_pos[:, g0:g1]  # [P, g, b]
    kp = band.k_pos[:, slot]  # [P|1, W, g, b]
    rows_p = max(qp.shape[0], kp.shape[0])
    qp_w = qp.unsqueeze(1).expand(rows_p, W, g, block)  # [P', W, g, b]
    kp_w = kp.expand(rows_p, W, g, block)  # [P', W, g, b]
    if spec.score_mods:
        qi = qp_w.permute(1, 2, 0, 3).unsqueeze(3).unsqueeze(-1)  # [W, g, P', 1, b, 1]
        ki = kp_w.permute(1, 2, 0, 3).unsqueeze(3).unsqueeze(-2)  # [W, g, P', 1, 1, b]
        s, _ = apply_score_mods(spec.score_mods, s, band.n_idx, band.h_idx, qi, ki)
    # Offsets whose tiles the pattern attends entirely in this group need no element mask.
    # (A key block cut by the end of the keys holds padding keys, which are never full.)
    nk = band.nk
    inside = (blk >= 0) & (blk < band.keys // block)  # [W, g]
    whole = inside & full[torch.arange(g0, g1)[None, :], blk.clamp(0, nk - 1).cpu()].to(dev)
    partial = [j for j in range(W) if not bool(whole[j].all())]
    if partial:
        sel = torch.tensor(partial, device=dev)
        allowed = spec.pattern.evaluate(qp_w[:, sel], kp_w[:, sel])  # [P', 1, w, g, b, b]
        allowed = allowed[:, 0].permute(1, 2, 0, 3, 4).unsqueeze(3)  # [w, g, P', 1, b, b]
        if band.grad:
            keep = torch.ones(W, *allowed.shape[1:], dtype=torch.bool, device=dev)
            keep[sel] = allowed
            s = s.masked_fill(~keep, float("-inf"))
        else:
            for r, j in enumerate(partial):
                s[j].masked_fill_(~allowed[r], -torch.inf)
    return s, qp


def _extra_scores(band: _Blocked, spec: MaskSpec, qp: Tensor, g0: int, g1: int) -> Tensor | None:
    """The masked scores of query blocks ``g0..g1-1`` against the extra keys,
    ``[g, N, H, b, X]`` (a pair the band covers masked out), or None without extra keys."""
    assert spec.pattern is not None
    X = int(band.extra.numel())
    if not X:
        return None
    block, kx_pos = band.block, band.kx_pos
    g, P = g1 - g0, qp.shape[0]
    dev = qp.device
    sx = torch.matmul(band.qb[g0:g1], band.kx.transpose(-1, -2))  # [g, N, H, b, X]
    rows = qp.reshape(P, g * block)  # [P, g*b]
    ok = spec.pattern.evaluate(rows.expand(max(P, kx_pos.shape[0]), -1), kx_pos)
    ok = ok[:, 0].view(-1, g, block, X)  # [P', g, b, X]
    q_blk = torch.arange(g0, g1, device=dev)  # [g]
    covered = torch.isin((band.extra // block)[None, :] - q_blk[:, None], band.offsets)  # [g, X]
    ok = (ok & ~covered[None, :, None, :]).permute(1, 0, 2, 3).unsqueeze(2)
    if spec.score_mods:
        qi = rows.view(P, g, block).permute(1, 0, 2).reshape(g, P, 1, block, 1)
        ki = kx_pos.view(1, -1, 1, 1, X)
        sx, _ = apply_score_mods(spec.score_mods, sx, band.n_idx[0], band.h_idx[0], qi, ki)
    return sx.masked_fill(~ok, float("-inf"))  # [g, N, H, b, X]


def _weighted_values(
    band: _Blocked, plan: BandPlan, s: Tensor, sx: Tensor | None, g0: int
) -> tuple[Tensor, Tensor]:
    """One safe softmax over the band's and the extra keys' scores of the query blocks
    from ``g0``, times their values: ``(out [g, N, H, b, Ev], lse [g, N, H, b])``."""
    W, g, N, H, block = s.shape[:5]
    vb, before, grad = band.vb, band.before, band.grad
    Ev = vb.shape[-1]
    m = s.amax(dim=(0, -1))  # [g, N, H, b]
    if sx is not None:
        m = torch.maximum(m, sx.amax(dim=-1))
    m = m.masked_fill(torch.isneginf(m), 0.0).detach()  # [g, N, H, b]
    e = torch.exp(s - m[None, ..., None]) if grad else s.sub_(m[None, ..., None]).exp_()
    denom = e.sum(dim=(0, -1))  # [g, N, H, b]
    dtype, dev = band.qb.dtype, band.qb.device
    out = torch.zeros(g * N * H, block, Ev, dtype=dtype, device=dev) if not grad else None
    parts: list[Tensor] = []
    e_flat = e.view(W, g * N * H, block, block)
    for j, d in enumerate(plan.offsets):
        vd = vb[before + d + g0 : before + d + g0 + g].reshape(g * N * H, block, Ev)
        if out is not None:
            out.baddbmm_(e_flat[j], vd)
        else:
            parts.append(torch.bmm(e_flat[j], vd))
    o = (out if out is not None else torch.stack(parts).sum(0)).view(g, N, H, block, Ev)
    if sx is not None:
        ex = torch.exp(sx - m[..., None])  # [g, N, H, b, X]
        denom = denom + ex.sum(dim=-1)
        o = o + torch.matmul(ex, band.vx)
    empty = denom == 0
    o = o / denom.masked_fill(empty, 1.0)[..., None]  # [g, N, H, b, Ev]
    lse = (m + torch.log(denom)).masked_fill(empty, float("-inf")).detach()
    return o, lse
