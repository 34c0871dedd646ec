"""The ``linear`` backend: kernelised linear attention, ``O(L)`` time and memory.

An approximation of softmax attention (Katharopoulos et al., 2020, "Transformers
are RNNs"), so it is registered with ``exact=False``: ``auto`` never picks it; it
runs only when named. It is tested against its own quadratic form,
:func:`attnlab.functional.linear_attention.linear_attention_reference`.

Non-causal: ``out = phi(Q) (phi(K)^T V) / (phi(Q) . sum_j phi(k_j))``.

Causal, by chunked prefix sums: the sequence is cut into chunks of ``C``
positions; inside a chunk the ``C x C`` causal quadratic form is used, and
everything before the chunk enters through the running state
``sum_{j < chunk} phi(k_j)^T v_j`` (an exclusive cumulative sum over chunk states),
so the work is ``O(L * C * E + L * E * Ev)`` and the memory ``O(L/C * E * Ev)``
(the chunked form of Katharopoulos et al.'s recurrence, as in Hua et al., 2022,
"Transformer quality in linear time", and Yang et al., 2023, "Gated linear attention").

Masks: none, causal (``is_causal`` or ``masks.causal()``), and key padding (a bool
mask ``[B.., 1|H, 1, S]`` or ``masks.padding(...)``). ``scale`` multiplies the
queries before the feature map; ``None`` means 1, as in the paper.

Shape notation: ``N`` flattened batch, ``H`` heads, ``L`` query length, ``S`` key
length, ``E`` head dim, ``Ev`` value head dim, ``nc`` chunks, ``C`` chunk length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.backend_traits import TRAITS
from attnlab.backends.blocks import compute_dtype, flatten_batch
from attnlab.backends.call import AttentionCall, Backend
from attnlab.backends.registry import register
from attnlab.functional.attention import empty_attention, repeat_kv
from attnlab.functional.linear_attention import elu_feature_map
from attnlab.functional.masks import Causal, MaskPattern, Padding

__all__ = ["CHUNK", "linear_attention"]

#: Chunk length of the causal form.
CHUNK = 64


def _causal_chunked(q: Tensor, k: Tensor, v: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
    """Causal numerator and denominator; ``q``/``k`` are features, all ``[N, H, n, *]``."""
    N, H, n, E = q.shape
    Ev = v.shape[-1]
    nc = -(-n // chunk)
    pad = nc * chunk - n
    qc = F.pad(q, (0, 0, 0, pad)).view(N, H, nc, chunk, E)  # [N, H, nc, C, E]
    kc = F.pad(k, (0, 0, 0, pad)).view(N, H, nc, chunk, E)  # [N, H, nc, C, E]
    vc = F.pad(v, (0, 0, 0, pad)).view(N, H, nc, chunk, Ev)  # [N, H, nc, C, Ev]
    tri = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    a = torch.matmul(qc, kc.transpose(-1, -2)).masked_fill(~tri, 0.0)  # [N, H, nc, C, C]
    num = torch.matmul(a, vc)  # [N, H, nc, C, Ev]
    den = a.sum(dim=-1)  # [N, H, nc, C]
    state = torch.matmul(kc.transpose(-1, -2), vc)  # [N, H, nc, E, Ev]
    before = torch.cumsum(state, dim=2) - state  # exclusive prefix over chunks
    z = kc.sum(dim=3)  # [N, H, nc, E]
    z_before = torch.cumsum(z, dim=2) - z
    num = num + torch.matmul(qc, before)
    den = den + (qc * z_before.unsqueeze(3)).sum(-1)
    num = num.reshape(N, H, nc * chunk, Ev)[:, :, :n]  # [N, H, n, Ev]
    den = den.reshape(N, H, nc * chunk)[:, :, :n]  # [N, H, n]
    return num, den


def _key_mask(
    attn_mask: Tensor | MaskPattern | None, query: Tensor, kv_len: int
) -> tuple[bool, Tensor | None]:
    """``(causal, key_keep [N, H|1, S] or None)`` from the supported masks."""
    if attn_mask is None:
        return False, None
    if isinstance(attn_mask, Causal):
        return True, None
    if isinstance(attn_mask, Padding):
        keep = attn_mask.keep.to(query.device)  # [B, S]
        return False, flatten_batch(keep[:, None, None, :])[:, :, 0]
    if (
        isinstance(attn_mask, Tensor)
        and attn_mask.dtype == torch.bool
        and attn_mask.shape[-2:-1] in ((), (1,))
    ):
        m = attn_mask.view((1,) * (query.dim() - attn_mask.dim()) + tuple(attn_mask.shape))
        m = m.expand(*query.shape[:-3], m.shape[-3], 1, kv_len)
        return False, flatten_batch(m)[:, :, 0]  # [N, H|1, S]
    what = (
        repr(attn_mask)
        if isinstance(attn_mask, MaskPattern)
        else f"a dense {attn_mask.dtype} mask of shape {tuple(attn_mask.shape)}"
    )
    raise ValueError(
        f"the linear backend applies only causal and key-padding (..., 1, S) masks, got {what}"
    )


def linear_attention(
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
    chunk: int = CHUNK,
) -> tuple[Tensor, Tensor | None]:
    """Linear attention with the ``elu + 1`` feature map (an approximation, not softmax).

    Shapes as :func:`attnlab.functional.sdpa_reference`; see the module docstring
    for the masks and the meaning of ``scale``.

    Returns:
        ``(output [B.., H, L, Ev], None)``.

    Raises:
        ValueError: another mask, ``dropout_p > 0`` or ``return_weights``.
    """
    if dropout_p > 0 or return_weights:
        raise ValueError(
            "the linear backend has no attention weights to drop out or return, got "
            f"dropout_p={dropout_p}, return_weights={return_weights}"
        )
    causal_pattern, keep = _key_mask(attn_mask, query, key.shape[-2])
    if query.shape[-2] == 0 or key.shape[-2] == 0:
        return empty_attention(query, key, value)[0], None
    causal = is_causal or causal_pattern
    dtype = query.dtype
    cdt = compute_dtype(dtype)
    q, k, v = (flatten_batch(t).to(cdt) for t in (query, key, value))  # [N, H, *, E]
    if q.shape[1] != k.shape[1]:
        n_rep = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # [N, H, S, E]
    L, S = q.shape[2], k.shape[2]
    fq = elu_feature_map(q * (1.0 if scale is None else scale))  # [N, H, L, E]
    fk = elu_feature_map(k)  # [N, H, S, E]
    if keep is not None:
        fk = fk * keep.unsqueeze(-1).to(cdt)  # a masked key contributes nothing
    if causal:
        # Top-left alignment: query i sees keys 0..i. Keys past L are never seen;
        # if S < L, pad with keys that contribute nothing.
        if S >= L:
            fk, v = fk[:, :, :L], v[:, :, :L]
        else:
            fk = F.pad(fk, (0, 0, 0, L - S))
            v = F.pad(v, (0, 0, 0, L - S))
        num, den = _causal_chunked(fq, fk, v, chunk)
    else:
        kv = torch.matmul(fk.transpose(-1, -2), v)  # [N, H, E, Ev]
        num = torch.matmul(fq, kv)  # [N, H, L, Ev]
        den = torch.matmul(fq, fk.sum(dim=2).unsqueeze(-1)).squeeze(-1)  # [N, H, L]
    den = den.unsqueeze(-1)
    out = num / den.masked_fill(den == 0, 1.0)
    return out.to(dtype).reshape(*query.shape[:-1], value.shape[-1]), None


def _check(call: AttentionCall) -> str | None:
    if call.positions:
        return "has no per-pair mask to evaluate q_positions/k_positions on"
    if call.pattern is not None and call.pattern.score_mods:
        return "has no softmax scores to modify"
    if call.dropout_p > 0 or call.return_weights:
        return "has no attention weights (to drop out or return)"
    if call.mask == "float":
        return "applies only causal and key-padding masks, got a float mask"
    if call.mask == "bool":
        return None  # that it is a key-padding (..., 1, S) mask is checked when it runs
    if call.pattern is not None and not isinstance(call.pattern, Causal | Padding):
        return f"applies only causal and key-padding masks, got {call.pattern!r}"
    return None


LINEAR = register(
    Backend(
        fn=linear_attention,
        check=_check,
        **TRAITS["linear"].registry_fields(),
    )
)
