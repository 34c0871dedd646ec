"""The backend ``auto`` would run for attention that the analysis tools describe by shapes.

The cost model (:mod:`attnlab.analysis.cost`) and the advisor describe a layer's
attention by its shapes, not by tensors. This module turns such a description into the
registry's own :class:`~attnlab.backends.call.AttentionCall` and asks the registry
(:func:`attnlab.backends.select.choose`): which backends refuse the call, what each
would cost (the measured constants of :mod:`attnlab.backends.cost_constants`) and which
wins are written once, in the backends. torch is imported when a choice is asked for,
never when ``attnlab.analysis`` is imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attnlab.backends.call import Explanation

__all__ = ["auto_choice"]


def auto_choice(
    *,
    batch_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_len: int,
    kv_len: int,
    dtype: str,
    training: bool,
    causal: bool,
    window: int | None = None,
    two_sided: bool = False,
    mask: Any = None,
    dense_mask: bool = False,
    positions: bool = False,
    device: str = "cpu",
) -> Explanation:
    """Ask the registry which backend ``auto`` runs for one layer's attention call.

    Args:
        batch_size: sequences per call.
        num_heads: query heads.
        num_kv_heads: key/value heads (fewer than ``num_heads``: grouped-query attention).
        head_dim: dim of each head.
        q_len: queries per sequence.
        kv_len: keys per sequence.
        dtype: a torch floating dtype's name (``"float32"``, ``"bfloat16"``, ...).
        training: gradients are needed (forward + backward constants; some backends refuse).
        causal: a causal mask (``is_causal``, or the window's own causality).
        window: a causal sliding window of ``window`` keys, passed as a pattern.
        two_sided: the window is bidirectional, ``window // 2`` keys on each side (an
            encoder's local layers).
        mask: a :class:`~attnlab.functional.masks.MaskPattern` the call passes (wins over
            ``window``).
        dense_mask: the call passes a dense mask (a pattern known only by its density).
        positions: the call passes query/key positions (cached decoding).
        device: the device type whose constants are used.

    Returns:
        The registry's :class:`~attnlab.backends.call.Explanation`: ``chosen``, the
        reason for each backend, and ``estimates`` (seconds, ranked).
    """
    import torch

    from attnlab.backends.call import AttentionCall
    from attnlab.backends.select import choose
    from attnlab.functional import masks

    pattern = mask
    if pattern is None and window is not None:
        half = window // 2
        pattern = (
            masks.sliding_window(half, half) if two_sided else masks.sliding_window(window - 1)
        )
    kind = "pattern" if pattern is not None else ("bool" if dense_mask else "none")
    call = AttentionCall(
        query_shape=(batch_size, num_heads, q_len, head_dim),
        key_shape=(batch_size, num_kv_heads, kv_len, head_dim),
        value_shape=(batch_size, num_kv_heads, kv_len, head_dim),
        dtype=getattr(torch, dtype),
        device=torch.device(device),
        mask=kind,
        pattern=pattern,
        is_causal=causal and (mask is not None or pattern is None) and not dense_mask,
        dropout_p=0.0,
        enable_gqa=num_kv_heads != num_heads,
        needs_grad=training,
        return_weights=False,
        positions=positions,
    )
    return choose(call, "auto")
