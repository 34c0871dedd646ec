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

import torch
from torch import Tensor
from torch.nn import functional as F

from attnlab.functional._checks import check_integer_tensor

__all__ = ["IGNORE_INDEX", "causal_lm_loss", "shift_right", "token_loss"]

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
    """Mean cross-entropy of ``logits [B, L, V]`` against ``labels [B, L]`` (no shift).

    Raises:
        TypeError: labels that are not integers.
        ValueError: labels whose shape is not the logits' ``[B, L]``.
    """
    _check(logits, labels)
    v = logits.shape[-1]
    return F.cross_entropy(
        logits.float().reshape(-1, v), labels.reshape(-1), ignore_index=ignore_index
    )


def causal_lm_loss(logits: Tensor, labels: Tensor, *, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Next-token cross-entropy: ``logits[:, t]`` predicts ``labels[:, t + 1]``.

    Equal to transformers' causal-LM loss: the labels are shifted left and padded with
    ``ignore_index``, so the last position predicts nothing.
    """
    _check(logits, labels)
    shifted = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]  # [B, L]
    return token_loss(logits, shifted, ignore_index=ignore_index)


def shift_right(labels: Tensor, *, start_token_id: int, pad_token_id: int) -> Tensor:
    """Decoder inputs from sequence-to-sequence labels (T5/BART's ``shift_tokens_right``).

    ``[start, y_0, ..., y_{L-2}]`` with ignored labels (``-100``) replaced by the pad id.
    """
    out = labels.new_full(labels.shape, start_token_id)
    out[..., 1:] = labels[..., :-1]
    return torch.where(out == IGNORE_INDEX, torch.full_like(out, pad_token_id), out)
