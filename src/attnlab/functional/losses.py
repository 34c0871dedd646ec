"""Language-model losses, with transformers' conventions.

Shape notation: ``B`` batch, ``L`` tokens, ``V`` vocabulary.

* Causal LM: the logits at position ``t`` predict the label at ``t + 1`` (the labels are
  the inputs; the shift happens here, as in transformers' ``ForCausalLMLoss``).
* Masked LM and sequence-to-sequence: the logits at ``t`` predict the label at ``t``
  (no shift).

Labels equal to ``ignore_index`` (``-100``) do not count; the loss is the mean over the
counted tokens, computed in float32 whatever the logits' dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from attnlab.functional._checks import check_integer_tensor

__all__ = [
    "IGNORE_INDEX",
    "causal_lm_loss",
    "chunked_causal_lm_loss",
    "shift_right",
    "token_loss",
]

#: Labels with this value are not predicted (transformers' and PyTorch's default).
IGNORE_INDEX = -100


def _check(logits: Tensor, labels: Tensor) -> None:
    check_integer_tensor("labels", labels)
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"labels must be (batch, seq_len) = {tuple(logits.shape[:-1])} like the logits, "
            f"got {tuple(labels.shape)}"
        )


def token_loss(logits: Tensor, labels: Tensor, *, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Mean cross-entropy of ``logits [B, L, V]`` against ``labels [B, L]`` (no shift), in
    float32 for 16-bit logits and in the logits' dtype otherwise.

    Raises:
        TypeError: labels that are not integers.
        ValueError: labels whose shape is not the logits' ``[B, L]``.
    """
    _check(logits, labels)
    v = logits.shape[-1]
    logits = logits.to(_loss_dtype(logits.dtype))  # 16-bit logits: float32; float64 stays
    return F.cross_entropy(logits.reshape(-1, v), labels.reshape(-1), ignore_index=ignore_index)


def causal_lm_loss(logits: Tensor, labels: Tensor, *, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Next-token cross-entropy: ``logits[:, t]`` predicts ``labels[:, t + 1]``.

    Equal to transformers' causal-LM loss: the labels are shifted left and padded with
    ``ignore_index``, so the last position predicts nothing.
    """
    _check(logits, labels)
    shifted = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]  # [B, L]
    return token_loss(logits, shifted, ignore_index=ignore_index)


#: Logit elements per chunk of :func:`chunked_causal_lm_loss` (32 MiB of float32).
CHUNK_ELEMENTS = 1 << 23


def _loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a loss is computed in: float32 for 16-bit logits, else their own."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _chunk_nll(head: Callable[[Tensor], Tensor], h: Tensor, t: Tensor) -> Tensor:
    """Summed cross-entropy of ``head(h) [T, V]`` against ``t [T]`` (:func:`_loss_dtype`)."""
    logits = head(h)
    return F.cross_entropy(logits.to(_loss_dtype(logits.dtype)), t, reduction="sum")


def chunked_causal_lm_loss(
    hidden: Tensor,
    head: Callable[[Tensor], Tensor],
    labels: Tensor,
    *,
    vocab_size: int,
    chunk_tokens: int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor:
    """:func:`causal_lm_loss` of ``head(hidden)`` without the full ``[B, L, V]`` logits.

    Only the positions that predict a counted label go through ``head`` (an SFT batch's
    prompt tokens never do), a chunk of ``chunk_tokens`` of them at a time, and each
    chunk's logits are recomputed in the backward instead of kept
    (:func:`torch.utils.checkpoint.checkpoint`): the memory held for the loss is one
    chunk's logits, not the batch's logits, log-probabilities and their gradient in
    float32. Equal to :func:`causal_lm_loss` of the full logits up to float rounding
    (the same per-token terms, summed in another order).

    Args:
        hidden: ``[B, L, D]`` final hidden states.
        head: ``[T, D] -> [T, V]``, the output head (soft-capping included).
        labels: ``[B, L]`` target ids, unshifted (``ignore_index`` = not counted).
        vocab_size: ``V``, to size the chunks.
        chunk_tokens: positions per chunk; default: ``2**23 // V`` (32 MiB of float32
            logits), at least 16.
        ignore_index: the label that does not count.

    Raises:
        TypeError: labels that are not integers.
        ValueError: labels whose shape is not ``hidden``'s ``[B, L]``, a chunk size below 1.
    """
    check_integer_tensor("labels", labels)
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"labels must be (batch, seq_len) = {tuple(hidden.shape[:-1])} like the hidden "
            f"states, got {tuple(labels.shape)}"
        )
    if chunk_tokens is None:
        chunk_tokens = max(16, CHUNK_ELEMENTS // max(int(vocab_size), 1))
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive integer, got {chunk_tokens!r}")
    shifted = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].reshape(-1)  # [B * L]
    rows = (shifted != ignore_index).nonzero().squeeze(1)  # [T] positions that predict
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)  # [T, D]
    targets = shifted.index_select(0, rows)  # [T]
    total = hidden.new_zeros((), dtype=_loss_dtype(hidden.dtype))
    for at in range(0, int(rows.numel()), chunk_tokens):
        hc, tc = h[at : at + chunk_tokens], targets[at : at + chunk_tokens]
        if torch.is_grad_enabled():
            part = checkpoint(_chunk_nll, head, hc, tc, use_reentrant=False)
        else:
            part = _chunk_nll(head, hc, tc)
        total = total + part
    return total / rows.numel()  # no counted label: 0 / 0 = NaN, as causal_lm_loss


def shift_right(labels: Tensor, *, start_token_id: int, pad_token_id: int) -> Tensor:
    """Decoder inputs from sequence-to-sequence labels (T5/BART's ``shift_tokens_right``).

    ``[start, y_0, ..., y_{L-2}]`` with ignored labels (``-100``) replaced by the pad id.
    """
    out = labels.new_full(labels.shape, start_token_id)
    out[..., 1:] = labels[..., :-1]
    return torch.where(out == IGNORE_INDEX, torch.full_like(out, pad_token_id), out)
