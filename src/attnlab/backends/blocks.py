"""What the block-wise backends (``tiled``, ``sparse``) share: one call's mask as tiles.

A call's mask can be a structured pattern, a dense bool/float tensor, ``is_causal``,
or several of these at once. :class:`MaskSpec` holds them in one place, in the
flattened layout the block-wise backends use, and answers the two questions a
block-sparse kernel asks (Dao et al., 2022, "FlashAttention", section 3.3 on
block-sparse attention; Child et al., 2019, "Generating long sequences with sparse
transformers"):

* which ``block_q x block_k`` tiles of the score matrix hold an attended pair
  (:meth:`MaskSpec.tiles`), so that the others are never computed;
* for one tile, the element mask (:meth:`MaskSpec.tile_allowed`) and the additive
  bias (:meth:`MaskSpec.tile_bias`); a tile that the pattern attends entirely needs
  neither.

It also recomputes attention weights from a saved log-sum-exp
(:func:`weights_from_lse`), which is how every exact block-wise backend returns
weights without keeping the ``L x S`` matrix during the computation.

Shape notation: ``N`` flattened batch, ``H`` heads, ``L`` query length, ``S`` key
length, ``E`` head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from attnlab.functional.attention import repeat_kv
from attnlab.functional.masks import MaskPattern, causal, default_positions, full
from attnlab.functional.masks.geometry import reduce_tiles
from attnlab.functional.score_mods import ScoreMod, apply_score_mods, score_mods_backward

__all__ = [
    "MaskSpec",
    "compute_dtype",
    "flatten_batch",
    "mask_spec",
    "prologue",
    "weights_from_lse",
]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types (softmax and normalisers in float32), else ``dtype``."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def flatten_batch(x: Tensor) -> Tensor:
    """``[B.., H, L, E] -> [N, H, L, E]``; a 3-D ``(B, L, E)`` becomes ``[1, B, L, E]``."""
    if x.dim() == 3:
        return x.unsqueeze(0)
    return x.reshape(-1, *x.shape[-3:])


def _flatten_mask(mask: Tensor, target: tuple[int, ...]) -> Tensor:
    """A dense mask broadcasting to ``target`` ``[B.., H, L, S]`` as ``[N|1, H|1, L|1, S|1]``."""
    m = mask.view((1,) * (len(target) - mask.dim()) + tuple(mask.shape))
    if len(target) == 3:
        return m.unsqueeze(0)
    lead = m.shape[:-3]
    if all(d == 1 for d in lead):
        return m.reshape(1, *m.shape[-3:])
    return m.expand(*target[:-3], *m.shape[-3:]).reshape(-1, *m.shape[-3:])


def _slice_rows_cols(m: Tensor, q0: int, q1: int, k0: int, k1: int) -> Tensor:
    rows = slice(q0, q1) if m.shape[-2] > 1 else slice(None)
    cols = slice(k0, k1) if m.shape[-1] > 1 else slice(None)
    return m[..., rows, cols]


@dataclass
class MaskSpec:
    """One call's mask, in the flattened ``[N, H, L, S]`` layout.

    Attributes:
        pattern: the structured part (``is_causal`` folded in as ``& causal()``), or None.
        dense: a dense bool (True = attend) or float (added) mask ``[N|1, H|1, L|1, S|1]``.
        n: flattened batch size ``N``.
        q_len: ``L``.
        kv_len: ``S``.
        q_pos: long ``[N|1, L]``, each query's position (slot).
        k_pos: long ``[N|1, S]``, each key's position, ``-1`` for an empty entry.
        score_mods: modifiers applied to the scaled scores before the mask.
    """

    pattern: MaskPattern | None
    dense: Tensor | None
    n: int
    q_len: int
    kv_len: int
    q_pos: Tensor
    k_pos: Tensor
    score_mods: tuple[ScoreMod, ...] = ()

    def _indices(self, scores: Tensor, q0: int, q1: int, k0: int, k1: int) -> tuple[Tensor, ...]:
        """``(b, h, q, k)`` index tensors of a tile ``[N, H, q1-q0, k1-k0]`` for score modifiers."""
        dev = scores.device
        b = torch.arange(scores.shape[0], device=dev).view(-1, 1, 1, 1)  # [N, 1, 1, 1]
        h = torch.arange(scores.shape[1], device=dev).view(-1, 1, 1)  # [H, 1, 1]
        qi = self.q_pos[:, q0:q1].unsqueeze(1).unsqueeze(-1)  # [N|1, 1, lq, 1]
        ki = self.k_pos[:, k0:k1].unsqueeze(1).unsqueeze(-2)  # [N|1, 1, 1, lk]
        return b, h, qi, ki

    @property
    def parameters(self) -> tuple[Tensor, ...]:
        """The learned tensors of the score modifiers (a T5 bias table), in order."""
        return tuple(p for m in self.score_mods for p in m.parameters())

    def modify_backward(
        self, scores: Tensor, q0: int, q1: int, k0: int, k1: int, grad: Tensor
    ) -> tuple[Tensor, list[Tensor]]:
        """Back-propagate ``grad`` (w.r.t. the modified tile) to the unmodified ``scores``
        and to the modifiers' parameters (:func:`~attnlab.functional.score_mods.score_mods_backward`).
        """
        b, h, qi, ki = self._indices(scores, q0, q1, k0, k1)
        return score_mods_backward(self.score_mods, scores, b, h, qi, ki, grad)

    @property
    def empty(self) -> bool:
        """True when nothing is masked or modified."""
        return self.pattern is None and self.dense is None and not self.score_mods

    def modify(
        self, scores: Tensor, q0: int, q1: int, k0: int, k1: int, *, derivative: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Apply the score modifiers to a tile ``[N, H, q1-q0, k1-k0]`` of scaled scores.

        Returns the modified scores and, if ``derivative``, ``d modified / d scores``
        (None when it is 1).
        """
        if not self.score_mods:
            return scores, None
        b, h, qi, ki = self._indices(scores, q0, q1, k0, k1)
        out, deriv = apply_score_mods(self.score_mods, scores, b, h, qi, ki)
        return out, (deriv if derivative else None)

    def tiles(self, block_q: int, block_k: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """``(needed, full)`` bool ``[nq, nk]`` on the CPU.

        ``needed`` tiles may hold an attended pair; ``full`` tiles are attended
        entirely (no element mask, no bias).
        """
        nq, nk = -(-self.q_len // block_q), -(-self.kv_len // block_k)
        needed = torch.ones(nq, nk, dtype=torch.bool)
        full = torch.ones(nq, nk, dtype=torch.bool)
        if self.pattern is not None:
            a, b = self.pattern.block_mask(
                self.q_len,
                self.kv_len,
                block_q,
                block_k,
                q_positions=self.q_pos.cpu(),
                k_positions=self.k_pos.cpu(),
            )
            needed, full = needed & a, full & b
        if self.dense is not None:
            full = torch.zeros_like(full)
            d = self.dense
            ok = d if d.dtype == torch.bool else ~torch.isneginf(d)
            ok = ok.reshape(-1, ok.shape[-2], ok.shape[-1]).any(0)  # [L|1, S|1]
            if ok.shape[-2] > 1:
                ok = reduce_tiles(ok.transpose(0, 1), block_q, nq, "any").transpose(0, 1)
            if ok.shape[-1] > 1:
                ok = reduce_tiles(ok, block_k, nk, "any")  # [nq|1, nk]
            needed = needed & ok.cpu()
        return needed, full

    def tile_allowed(
        self, q0: int, q1: int, k0: int, k1: int, device: torch.device
    ) -> Tensor | None:
        """Bool mask of the tile ``[q0:q1, k0:k1]`` broadcasting to ``[N, H, q1-q0, k1-k0]``.

        ``None`` when the tile has no boolean constraint.
        """
        allowed: Tensor | None = None
        if self.pattern is not None:
            allowed = self.pattern.evaluate(self.q_pos[:, q0:q1], self.k_pos[:, k0:k1])
        if self.dense is not None and self.dense.dtype == torch.bool:
            d = _slice_rows_cols(self.dense, q0, q1, k0, k1)
            allowed = d if allowed is None else allowed & d
        return allowed

    def tile_bias(self, q0: int, q1: int, k0: int, k1: int) -> Tensor | None:
        """Float bias of the tile (broadcasting to ``[N, H, q1-q0, k1-k0]``) or None."""
        if self.dense is None or self.dense.dtype == torch.bool:
            return None
        return _slice_rows_cols(self.dense, q0, q1, k0, k1)


def prologue(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | MaskPattern | None,
    is_causal: bool,
    scale: float | None,
    *,
    q_positions: Tensor | None = None,
    k_positions: Tensor | None = None,
    dtype: torch.dtype | None = None,
    repeat_heads: bool = True,
) -> tuple[Tensor, Tensor, Tensor, MaskSpec, float]:
    """What every block-wise backend does first, in one place.

    Gathers the mask and positions (:func:`mask_spec`), flattens the batch dims
    (``[B.., H, *, E] -> [N, H, *, E]``), casts to ``dtype`` (the compute dtype, when
    given), repeats the key/value heads to the query heads (GQA), and resolves the
    default scale ``1/sqrt(E)``.

    Returns:
        ``(q [N, H, L, E], k [N, H|H_kv, S, E], v [N, H|H_kv, S, Ev], spec, scale)``.
    """
    spec = mask_spec(
        attn_mask,
        is_causal,
        tuple(query.shape),
        key.shape[-2],
        device=query.device,
        q_positions=q_positions,
        k_positions=k_positions,
    )
    q, k, v = flatten_batch(query), flatten_batch(key), flatten_batch(value)  # [N, H, *, E]
    if dtype is not None:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if repeat_heads and q.shape[1] != k.shape[1]:
        n_rep = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # [N, H, S, E]
    return q, k, v, spec, 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def check_blockwise_call(
    backend: str, attn_mask: object, dropout_p: float, *, needs_pattern: bool
) -> None:
    """Refuse what the tile-by-tile backends cannot do, naming the backend and the values.

    Raises:
        ValueError: ``dropout_p > 0``; a dense mask where ``needs_pattern`` (only a
            pattern says which blocks are empty without reading the whole mask).
    """
    if dropout_p > 0:
        raise ValueError(f"the {backend} backend does not apply dropout, got dropout_p={dropout_p}")
    if needs_pattern and isinstance(attn_mask, Tensor):
        raise ValueError(
            f"the {backend} backend needs a mask pattern (attnlab.functional.masks), got a dense "
            f"{attn_mask.dtype} mask of shape {tuple(attn_mask.shape)}"
        )


def mask_spec(
    attn_mask: Tensor | MaskPattern | None,
    is_causal: bool,
    query_shape: tuple[int, ...],
    kv_len: int,
    *,
    device: torch.device | None = None,
    q_positions: Tensor | None = None,
    k_positions: Tensor | None = None,
) -> MaskSpec:
    """Gather a call's mask and positions into one :class:`MaskSpec`.

    Positions default to ``arange`` (torch's top-left alignment). Key positions make
    the pattern at least ``full()``, so that empty keys (``-1``) are masked.

    Raises:
        ValueError: a batch-dependent pattern whose batch size does not match the inputs.
    """
    target = (*query_shape[:-1], kv_len)  # [B.., H, L, S]
    n = 1 if len(query_shape) == 3 else math.prod(query_shape[:-3])
    pattern: MaskPattern | None = None
    dense: Tensor | None = None
    mods: tuple[ScoreMod, ...] = ()
    if isinstance(attn_mask, MaskPattern):
        mods = attn_mask.score_mods
        for m in mods:
            m.check_heads(query_shape[-3])
        attn_mask = attn_mask._unscored()
        if attn_mask.batch_dependent:
            batch = query_shape[:-3]
            if len(batch) != 1 or batch[0] != attn_mask.batch_size:
                raise ValueError(
                    f"pattern {attn_mask!r} was built for batch size {attn_mask.batch_size}, "
                    f"but the inputs have batch dims {tuple(batch)}"
                )
        pattern = attn_mask
    elif attn_mask is not None:
        dense = _flatten_mask(attn_mask, target)
    if is_causal:
        pattern = causal() if pattern is None else pattern & causal()
    if pattern is None and k_positions is not None:
        pattern = full()
    L = query_shape[-2]
    q_pos = default_positions(L, device=device) if q_positions is None else q_positions
    k_pos = default_positions(kv_len, device=device) if k_positions is None else k_positions
    return MaskSpec(
        pattern=pattern,
        dense=dense,
        n=n,
        q_len=L,
        kv_len=kv_len,
        q_pos=q_pos,
        k_pos=k_pos,
        score_mods=mods,
    )


def masked_scores(
    scores: Tensor, spec: MaskSpec, q0: int, q1: int, k0: int, k1: int, full: bool
) -> Tensor:
    """Apply the tile's bias and element mask to ``scores`` ``[N, H, q1-q0, k1-k0]`` in place."""
    if full:
        return scores
    bias = spec.tile_bias(q0, q1, k0, k1)
    if bias is not None:
        scores = scores.add_(bias.to(scores.dtype))
    allowed = spec.tile_allowed(q0, q1, k0, k1, scores.device)
    if allowed is not None:
        scores = scores.masked_fill_(~allowed, float("-inf"))
    return scores


def weights_from_lse(
    q: Tensor,
    k: Tensor,
    lse: Tensor,
    spec: MaskSpec,
    scale: float,
    *,
    heads: Tensor | None = None,
    rows: Tensor | None = None,
) -> Tensor:
    """Recompute softmax weights ``exp(q k^T * scale + mask - lse)`` for chosen heads and rows.

    The log-sum-exp of each row is what FlashAttention keeps for its backward
    (Dao, 2023, "FlashAttention-2", section 3.1.2); with it, any row of the
    attention matrix costs one ``1 x S`` product and no second pass.

    Args:
        q: ``[N, H, L, E]`` in the compute dtype.
        k: ``[N, H, S, E]`` (heads already matched to ``q``).
        lse: ``[N, H, L]``, ``-inf`` for a fully masked row.
        spec: the call's mask.
        scale: score scale.
        heads: head indices to keep (default all).
        rows: query row indices to keep (default all).

    Returns:
        ``[N, len(heads), len(rows), S]``; fully masked rows are zero.
    """
    dev = q.device
    h_idx = torch.arange(q.shape[1], device=dev) if heads is None else heads.to(dev)
    r_idx = torch.arange(q.shape[2], device=dev) if rows is None else rows.to(dev)
    qs = q[:, h_idx][:, :, r_idx] * scale  # [N, h, r, E]
    scores = qs @ k[:, h_idx].transpose(-1, -2)  # [N, h, r, S]
    q_pos = spec.q_pos[:, r_idx]  # [N|1, r]
    if spec.score_mods:
        n_idx = torch.arange(q.shape[0], device=dev).view(-1, 1, 1, 1)  # [N, 1, 1, 1]
        qi = q_pos.unsqueeze(1).unsqueeze(-1)  # [N|1, 1, r, 1]
        ki = spec.k_pos.unsqueeze(1).unsqueeze(-2)  # [N|1, 1, 1, S]
        scores, _ = apply_score_mods(spec.score_mods, scores, n_idx, h_idx.view(-1, 1, 1), qi, ki)
    if spec.dense is not None:
        d = spec.dense
        d = d[:, h_idx] if d.shape[1] > 1 else d
        d = d[:, :, r_idx] if d.shape[2] > 1 else d
        if d.dtype == torch.bool:
            scores = scores.masked_fill(~d, float("-inf"))
        else:
            scores = scores + d.to(scores.dtype)
    if spec.pattern is not None:
        allowed = spec.pattern.evaluate(q_pos, spec.k_pos)  # [N|1, 1, r, S]
        scores = scores.masked_fill(~allowed, float("-inf"))
    row_lse = lse[:, h_idx][:, :, r_idx]  # [N, h, r]
    row_lse = row_lse.masked_fill(torch.isneginf(row_lse), float("inf"))
    return torch.exp(scores - row_lse.unsqueeze(-1))
