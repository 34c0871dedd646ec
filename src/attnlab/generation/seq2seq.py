"""The decoding loop of an encoder-decoder: the encoder once, then one decoder token a step."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from attnlab.generation.inputs import check_fresh_cache

__all__ = ["stream_seq2seq"]


def stream_seq2seq(
    model: Any,
    input_ids: Tensor,
    max_new_tokens: int,
    attention_mask: Tensor | None,
    choose: Callable[[Tensor], Tensor],
    cache: Any,
) -> Iterator[Tensor]:
    """Yield ``choose(logits)`` ``[B]`` for up to ``max_new_tokens`` decoder steps.

    The caller stops the iteration when every row has finished.
    """
    b = input_ids.shape[0]
    encoder_out = model.encode(input_ids, attention_mask=attention_mask)  # [B, S_enc, D]
    if cache is None:
        cache = model.new_cache(max_length=max_new_tokens + 1)
    else:
        check_fresh_cache(cache)
    start_id = model.config.decoder_start_token_id
    tok = torch.full((b,), start_id, dtype=torch.long, device=input_ids.device)
    for _ in range(max_new_tokens):
        out = model(
            attention_mask=attention_mask,
            decoder_input_ids=tok[:, None],
            encoder_outputs=encoder_out,
            past_key_values=cache,
            use_cache=True,
        )
        tok = choose(out.logits)
        yield tok
