"""The ``sdpa`` backend: torch's own fused kernel, made safe for fully masked rows.

torch returns NaN for a query row whose keys are all masked; attnlab promises
zeros. This backend finds such rows from the mask (cheap: one reduction over the
mask, which is usually ``(B, 1, 1, S)``), lets them attend everything inside the
kernel, and zeroes their output, so values and gradients stay finite.

A decode step's call (one query over every key, no mask, float32 on the CPU, no
gradient, at most 16 query heads per key/value head) runs attnlab's decode kernel instead
(:mod:`attnlab.backends.decode_attention`), which reads each key once for the whole
GQA group where torch's flash kernel tiles it as a prompt; ``ATTNLAB_DECODE_KERNEL=0``
keeps torch's kernel.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.backend_traits import TRAITS
from attnlab.backends.call import AttentionCall, Backend
from attnlab.backends.cost_model import Estimate, estimate, lse_pass
from attnlab.backends.decode_attention import decode_attention, fits
from attnlab.backends.registry import register
from attnlab.functional.attention import empty_attention, sdpa_reference
from attnlab.functional.masks import causal_mask


def _check(call: AttentionCall) -> str | None:
    if call.pattern is not None and call.pattern.score_mods:
        return f"cannot apply score modifiers {list(call.pattern.score_mods)} inside torch's kernel"
    return None


def sdpa_torch(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    return_weights: bool = False,
    check_finite: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Run :func:`torch.nn.functional.scaled_dot_product_attention` with attnlab's guarantees.

    Shapes as in :func:`attnlab.functional.sdpa_reference`. With ``return_weights``
    the weights are recomputed from a log-sum-exp (:func:`attnlab.backends.attention_weights`).
    ``check_finite=False`` (a model's trusted call) skips the non-finite check: inside a
    model a NaN in the query or key is also in the residual stream, so it reaches the
    logits whatever this kernel does, and ``generate`` checks those every step.
    """
    L, S = query.shape[-2], key.shape[-2]
    if L == 0 or S == 0:
        return empty_attention(query, key, value, return_weights=return_weights)
    acc = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else None
    # (skipped inside a compiled decode step: no host sync there; its caller checks the
    # logits of every step instead)
    if (
        check_finite
        and not torch.compiler.is_compiling()
        and not math.isfinite(
            float(query.detach().sum(dtype=acc)) + float(key.detach().sum(dtype=acc))
        )
    ):
        # torch's kernels do not propagate a NaN in the query or key at some shapes (small
        # lengths and head dims), and propagate it from masked keys at others: non-finite
        # inputs take the reference math, which every backend agrees with. One reduction
        # per call (a host sync), not one per element-op.
        return sdpa_reference(
            query,
            key,
            value,
            attn_mask,
            dropout_p,
            is_causal,
            scale,
            enable_gqa,
            return_weights=return_weights,
        )
    given_mask, given_causal = attn_mask, is_causal
    if (
        attn_mask is None
        and not is_causal
        and dropout_p == 0.0
        and L == 1
        and (enable_gqa or query.shape[-3] == key.shape[-3])
        and fits(query, key, value)
    ):  # a decode step: every query sees every key
        out = decode_attention(
            query, key, value, query.shape[-1] ** -0.5 if scale is None else scale
        )
        weights = None
        if return_weights:
            from attnlab.backends.weights import attention_weights

            weights = attention_weights(query, key, None, False, scale, enable_gqa)
        return out, weights
    if attn_mask is not None and is_causal:
        causal = causal_mask(L, S, device=query.device)
        attn_mask = (
            attn_mask & causal
            if attn_mask.dtype == torch.bool
            else attn_mask.masked_fill(~causal, float("-inf"))
        )
        is_causal = False
    row_ok: Tensor | None = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            row_ok = attn_mask.any(dim=-1, keepdim=True)  # [.., L, 1]
            # Compiled (a decode step): no host sync, the fix-up runs unconditionally.
            if torch.compiler.is_compiling() or not bool(row_ok.all()):
                attn_mask = attn_mask | ~row_ok
            else:
                row_ok = None
        else:
            attn_mask = attn_mask.to(query.dtype)
            row_ok = (~torch.isneginf(attn_mask)).any(dim=-1, keepdim=True)
            if torch.compiler.is_compiling() or not bool(row_ok.all()):
                attn_mask = attn_mask.masked_fill(~row_ok, 0.0)
            else:
                row_ok = None
    if attn_mask is not None and attn_mask.dim() < query.dim():
        # torch's fused CPU kernel takes a mask of the query's rank only; a lower-rank
        # one (a broadcast [1, L, S]) sends it to the math path, which repeats the
        # key/value heads for GQA: 20x slower for a decode step at 2048 keys
        attn_mask = attn_mask.view((1,) * (query.dim() - attn_mask.dim()) + attn_mask.shape)
    gqa = enable_gqa and query.shape[-3] != key.shape[-3]
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=gqa,
    )
    if row_ok is not None:
        out = out.masked_fill(~row_ok, 0.0)
    weights = None
    if return_weights:
        # torch's kernel keeps no log-sum-exp: get it from a tiled pass (O(L) memory)
        # and recompute the weights from it, as every block-wise backend does.
        from attnlab.backends.weights import attention_weights

        weights = attention_weights(query, key, given_mask, given_causal, scale, enable_gqa)
    return out, weights


def _cost(call: AttentionCall) -> Estimate | None:
    L, S = call.query_shape[-2], call.key_shape[-2]
    flash = call.mask == "none"  # no mask, or is_causal only: torch's flash path
    est = estimate(
        "sdpa_flash" if flash else "sdpa", call, L * S / 2 if flash and call.is_causal else L * S
    )
    if est is None:
        return None
    if call.return_weights:
        est = Estimate(est.seconds + lse_pass(call), est.note + " + a tiled pass for the weights")
    if call.pattern is None:
        return est
    return Estimate(
        est.seconds,
        f"cannot skip the empty blocks of {call.pattern!r}: builds a dense {L}x{S} mask, {est.note}",
    )


SDPA = register(
    Backend(
        fn=sdpa_torch,
        check=_check,
        cost=_cost,
        trusted_fn=functools.partial(sdpa_torch, check_finite=False),
        **TRAITS["sdpa"].registry_fields(),
    )
)
