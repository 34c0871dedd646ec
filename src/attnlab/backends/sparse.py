"""The ``sparse`` backend: block-sparse attention that computes only the tiles a pattern needs.

The sequence is cut into blocks of ``block`` positions. For every query block the
pattern names the key blocks it touches (:meth:`MaskPattern.block_mask`); those key
blocks are gathered side by side and the query block meets them in one batched
product, followed by an ordinary (safe) softmax over the gathered keys. Work and
memory therefore grow with ``L * w`` for a pattern in which each query sees about
``w`` keys (a sliding window, Longformer's global + local attention, a dilated
window, block-diagonal documents), not with ``L * S`` (Child et al., 2019,
"Generating long sequences with sparse transformers"; Beltagy et al., 2020,
"Longformer: the long-document transformer"; Zaheer et al., 2020, "Big Bird").

When the needed blocks form a band around the diagonal plus a few key columns (a
sliding window, Longformer's window and global keys), the banded path of
:mod:`attnlab.backends.banded` runs instead: the key blocks are read in place, one
batched product per block offset, and the few column keys are gathered one by one.
Other patterns take the gather path below.

Unlike ``tiled`` there is no online softmax: one query block sees all its key
blocks at once, so the backward is torch's autograd through a few large batched
operations, which is faster on a CPU than a Python loop over tiles. Query blocks
are processed in groups whose gathered scores stay under a fixed budget, so a few
dense rows (global tokens) do not make every row pay for them.

Shape notation: ``N`` flattened batch, ``H`` query heads, ``L`` query length,
``S`` key length, ``E`` head dim, ``Ev`` value head dim, ``nq``/``nk`` query/key
blocks, ``K`` key blocks gathered per query block.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.backend_traits import TRAITS
from attnlab.backends.banded import BAND_BLOCKS, band_pairs, banded_core, choose_band
from attnlab.backends.blocks import (
    MaskSpec,
    check_blockwise_call,
    compute_dtype,
    prologue,
    weights_from_lse,
)
from attnlab.backends.call import AttentionCall, Backend
from attnlab.backends.cost_model import Estimate, computed_pairs, estimate
from attnlab.backends.registry import register
from attnlab.functional.attention import empty_attention
from attnlab.functional.masks import MaskPattern, causal, full
from attnlab.functional.score_mods import apply_score_mods

__all__ = ["BLOCK", "SCORE_BUDGET", "sparse_attention"]

#: Positions per block. Small blocks waste little at a window's edges.
BLOCK = TRAITS["sparse"].tile()[0]
#: Scores (``N * H * rows * gathered keys``) computed at once, per group of query blocks.
SCORE_BUDGET = 1 << 25
#: The banded path's budget: smaller groups of query blocks reuse freed buffers (no fresh
#: pages per call) and were faster at 4096 tokens on this project's CPU.
BAND_SCORE_BUDGET = 1 << 22


def _groups(counts: list[int], tiles_budget: int) -> list[tuple[int, int]]:
    """Split query blocks into runs whose ``len(run) * max(count in run)`` fits the budget."""
    groups: list[tuple[int, int]] = []
    start, widest = 0, 0
    for i, c in enumerate(counts):
        w = max(widest, c)
        if i > start and (i - start + 1) * w > tiles_budget:
            groups.append((start, i))
            start, w = i, c
        widest = w
    if counts:
        groups.append((start, len(counts)))
    return groups


def _sparse_core(
    q: Tensor, k: Tensor, v: Tensor, spec: MaskSpec, scale: float, block: int
) -> tuple[Tensor, Tensor]:
    """Block-sparse attention on flattened inputs: ``(out [N, H, L, Ev], lse [N, H, L])``."""
    assert spec.pattern is not None and spec.dense is None
    N, H, L, E = q.shape
    S, Ev = k.shape[2], v.shape[-1]
    q_cpu, k_cpu = spec.q_pos.cpu(), spec.k_pos.cpu()
    masks: dict[int, tuple[Tensor, Tensor]] = {}

    def block_mask(b: int) -> tuple[Tensor, Tensor]:
        if b not in masks:
            assert spec.pattern is not None
            masks[b] = spec.pattern.block_mask(L, S, b, b, q_positions=q_cpu, k_positions=k_cpu)
        return masks[b]  # ([nq, nk], [nq, nk])

    # The default block tries the band at every size; a block the caller names, only at it.
    band = choose_band(block_mask, tuple(BAND_BLOCKS) if block == BLOCK else (block,))
    if band is not None:  # a band of tiles plus a few keys: read the key blocks in place
        b, plan, full_tiles = band
        return banded_core(q, k, v, spec, scale, b, plan, full_tiles, BAND_SCORE_BUDGET)
    needed = block_mask(block)[0]  # [nq, nk]
    nq, nk = needed.shape
    dev = q.device
    q_pad = F.pad(q, (0, 0, 0, nq * block - L))  # [N, H, nq*b, E]
    # One extra all-zero key block (index nk) pads the gathered lists.
    k_pad = F.pad(k, (0, 0, 0, (nk + 1) * block - S))  # [N, H, (nk+1)*b, E]
    v_pad = F.pad(v, (0, 0, 0, (nk + 1) * block - S))  # [N, H, (nk+1)*b, Ev]
    kt = k_pad.view(N, H, nk + 1, block, E)  # [N, H, nk+1, b, E]
    vt = v_pad.view(N, H, nk + 1, block, Ev)  # [N, H, nk+1, b, Ev]
    qt = q_pad.view(N, H, nq, block, E) * scale  # [N, H, nq, b, E]
    counts = needed.sum(1).tolist()
    cols = [needed[i].nonzero().flatten() for i in range(nq)]
    tiles_budget = max(1, SCORE_BUDGET // max(1, N * H * block * block))
    outs: list[Tensor] = []
    lses: list[Tensor] = []
    in_block = torch.arange(block, device=dev)
    # Positions of the padded rows and of the gathered keys; the padding keys are empty (-1).
    q_pos_pad = F.pad(spec.q_pos, (0, nq * block - L))  # [N|1, nq*b]
    k_pos_pad = F.pad(spec.k_pos, (0, (nk + 1) * block - S), value=-1)  # [N|1, (nk+1)*b]
    for g0, g1 in _groups(counts, tiles_budget):
        width = max(1, max(counts[g0:g1]))
        idx = torch.full((g1 - g0, width), nk, dtype=torch.long)  # [g, K]
        for r, i in enumerate(range(g0, g1)):
            idx[r, : counts[i]] = cols[i]
        idx = idx.to(dev)
        kg = kt[:, :, idx].reshape(N, H, g1 - g0, width * block, E)  # [N, H, g, K*b, E]
        vg = vt[:, :, idx].reshape(N, H, g1 - g0, width * block, Ev)  # [N, H, g, K*b, Ev]
        s = torch.matmul(qt[:, :, g0:g1], kg.transpose(-1, -2))  # [N, H, g, b, K*b]
        rows = torch.arange(g0 * block, g1 * block, device=dev).view(g1 - g0, block)  # [g, b]
        keys = (idx.unsqueeze(-1) * block + in_block).reshape(g1 - g0, -1)  # [g, K*b]
        q_pos, k_pos = q_pos_pad[:, rows], k_pos_pad[:, keys]  # [N|1, g, b], [N|1, g, K*b]
        if spec.score_mods:
            n_idx = torch.arange(N, device=dev).view(-1, 1, 1, 1, 1)  # [N, 1, 1, 1, 1]
            h_idx = torch.arange(H, device=dev).view(-1, 1, 1, 1)  # [H, 1, 1, 1]
            qi = q_pos.unsqueeze(1).unsqueeze(-1)  # [N|1, 1, g, b, 1]
            ki = k_pos.unsqueeze(1).unsqueeze(-2)  # [N|1, 1, g, 1, K*b]
            s, _ = apply_score_mods(spec.score_mods, s, n_idx, h_idx, qi, ki)
        allowed = spec.pattern.evaluate(q_pos, k_pos)  # [N|1, 1, g, b, K*b]
        grad = torch.is_grad_enabled() and s.requires_grad
        s = (
            s.masked_fill(~allowed, float("-inf"))
            if grad
            else s.masked_fill_(~allowed, float("-inf"))
        )
        m = s.amax(dim=-1, keepdim=True)
        m = m.masked_fill(torch.isneginf(m), 0.0).detach()
        e = torch.exp(s - m) if grad else s.sub_(m).exp_()  # unnormalised probabilities
        denom = e.sum(dim=-1, keepdim=True)  # [N, H, g, b, 1]
        empty = denom == 0
        # Normalise the output rather than the probabilities: Ev columns, not K*b.
        o = torch.matmul(e, vg) / denom.masked_fill(empty, 1.0)  # [N, H, g, b, Ev]
        outs.append(o.reshape(N, H, (g1 - g0) * block, Ev))
        lse = (m + torch.log(denom)).masked_fill(empty, float("-inf"))
        lses.append(lse.detach().reshape(N, H, (g1 - g0) * block))
    out = torch.cat(outs, dim=2)[:, :, :L]  # [N, H, L, Ev]
    return out, torch.cat(lses, dim=2)[:, :, :L]


def sparse_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | MaskPattern | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    return_weights: bool = False,
    block: int = BLOCK,
    q_positions: Tensor | None = None,
    k_positions: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Exact attention over only the blocks a mask pattern needs.

    ``q_positions`` ``[N|1, L]`` and ``k_positions`` ``[N|1, S]`` (``-1`` = empty key)
    place the queries and keys; the pattern and the score modifiers are evaluated on them.

    Shapes and conventions as :func:`attnlab.functional.sdpa_reference`. The mask
    must be a :class:`~attnlab.functional.masks.MaskPattern` and/or ``is_causal``
    (a dense tensor does not say which blocks are empty without reading all of it:
    use ``tiled`` for dense masks). ``dropout_p`` must be 0.

    Returns:
        ``(output [B.., H, L, Ev], weights [B.., H, L, S] or None)``.

    Raises:
        ValueError: a dense mask, ``dropout_p > 0``, or a pattern built for another batch size.
    """
    check_blockwise_call("sparse", attn_mask, dropout_p, needs_pattern=True)
    if query.shape[-2] == 0 or key.shape[-2] == 0:
        return empty_attention(query, key, value, return_weights=return_weights)
    dtype = query.dtype
    q, k, v, spec, scale = prologue(
        query,
        key,
        value,
        attn_mask,
        is_causal,
        scale,
        q_positions=q_positions,
        k_positions=k_positions,
        dtype=compute_dtype(dtype),
    )  # [N, H, *, E]
    if spec.pattern is None:
        spec.pattern = full()
    out, lse = _sparse_core(q, k, v, spec, scale, block)
    out = out.to(dtype).reshape(*query.shape[:-1], value.shape[-1])  # [B.., H, L, Ev]
    weights = None
    if return_weights:
        with torch.no_grad():
            w = weights_from_lse(q.detach(), k.detach(), lse, spec, scale)  # [N, H, L, S]
        weights = w.to(dtype).reshape(*query.shape[:-1], key.shape[-2])
    return out, weights


def _check(call: AttentionCall) -> str | None:
    if call.dropout_p > 0:
        return "does not apply dropout"
    if call.mask in ("bool", "float"):
        return "needs a mask pattern to know which blocks are empty, got a dense mask"
    return None


_MAX_CACHED = 128
_band_cache: OrderedDict[tuple[object, ...], tuple[MaskPattern | None, float | None]] = (
    OrderedDict()
)


def _banded_pairs(call: AttentionCall) -> float | None:
    """Pairs per head of the banded path for this call, or None when the gather path runs."""
    if call.pattern is None and not call.is_causal:
        return None
    L, S = call.query_shape[-2], call.key_shape[-2]
    key = (id(call.pattern), call.is_causal, L, S)
    hit = _band_cache.get(key)
    if hit is not None:
        return hit[1]
    pattern = call.pattern._unscored() if call.pattern is not None else None
    if call.is_causal:
        pattern = causal() if pattern is None else pattern & causal()
    assert pattern is not None
    pairs = band_pairs(pattern, L, S, tuple(BAND_BLOCKS))
    _band_cache[key] = (call.pattern, pairs)  # keeps the pattern alive: ids stay unique
    if len(_band_cache) > _MAX_CACHED:
        _band_cache.popitem(last=False)
    return pairs


def _cost(call: AttentionCall) -> Estimate | None:
    pairs = _banded_pairs(call)
    if pairs is not None:  # blocks read in place: its own, lower, per-pair cost
        return estimate("sparse_band", call, pairs)
    return estimate("sparse", call, computed_pairs(call, BLOCK, BLOCK))


SPARSE = register(
    Backend(
        fn=sparse_attention,
        check=_check,
        cost=_cost,
        **TRAITS["sparse"].registry_fields(),
    )
)
